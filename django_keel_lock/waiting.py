"""How waiters for a key take turns, how long they sleep, and how async calls finish.

`Lock.acquire`/`aacquire` wait with these; the decisions they share with each other live here
so the sync and async loops differ only in how they block.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .stores.base import LockStore

T = TypeVar("T")

_TurnName = tuple[asyncio.AbstractEventLoop | None, LockStore, str]


async def to_the_end(
    operation: Awaitable[T],
) -> tuple[asyncio.Future[T], asyncio.CancelledError | None]:
    """Run `operation` to its end even if the calling task is cancelled meanwhile.

    Returns the finished future (read its result or error) and the cancellation that arrived
    while waiting, if any: the caller settles what the operation did, then re-raises it.
    """
    future = asyncio.ensure_future(operation)
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if not future.cancelled():  # we were cancelled, the operation goes on
                cancelled = exc
        except Exception:
            pass  # the operation's own error: the caller reads it from the future
    return future, cancelled


class Turn:
    """Waiters for one key take turns: only the one whose turn it is tries the store and
    listens for releases (tasks in the order they came; threads as the OS wakes them). One turn
    per key for the threads of the process, and one per key for the tasks of each event loop.

    A release then wakes one waiter into a store round trip, not all of them: with many
    waiters, the store sees one attempt per release instead of one per waiter.
    """

    _mutex = threading.Lock()  # the registry is shared by every thread and loop of the process
    _registry: dict[_TurnName, Turn] = {}

    def __init__(self, name: _TurnName) -> None:
        self.name = name
        self.lock: Any = threading.Lock() if name[0] is None else asyncio.Lock()
        self.members = 0

    @classmethod
    def _join(cls, loop: asyncio.AbstractEventLoop | None, store: LockStore, key: str) -> Turn:
        with cls._mutex:
            turn = cls._registry.get((loop, store, key))
            if turn is None:
                turn = cls._registry[loop, store, key] = cls((loop, store, key))
            turn.members += 1
            return turn

    def _leave(self) -> None:
        with self._mutex:
            self.members -= 1
            if self.members == 0:
                del self._registry[self.name]

    @classmethod
    def wait_for(cls, store: LockStore, key: str, deadline: float) -> ThreadTurn:
        """A thread's turn at `key`: True once it is ours (until the block ends), False if it
        did not come by `deadline` (monotonic)."""
        return ThreadTurn(store, key, deadline)

    @classmethod
    @asynccontextmanager
    async def await_for(cls, store: LockStore, key: str, deadline: float) -> AsyncIterator[bool]:
        """`wait_for` for the tasks of the running event loop."""
        turn = cls._join(asyncio.get_running_loop(), store, key)
        try:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await turn.lock.acquire()
                mine = True
            except TimeoutError:
                mine = False
            try:
                yield mine
            finally:
                if mine:
                    turn.lock.release()
        finally:
            turn._leave()


class ThreadTurn:
    """`Turn.wait_for`'s block: the key's turn joined on entering, and waited for; left on
    leaving. A class and not a generator: leaving it is on the way from a grant to
    `acquire()` returning."""

    __slots__ = ("_deadline", "_key", "_mine", "_store", "_turn")

    def __init__(self, store: LockStore, key: str, deadline: float) -> None:
        self._store, self._key, self._deadline, self._mine = store, key, deadline, False

    def __enter__(self) -> bool:
        self._turn = Turn._join(None, self._store, self._key)
        try:
            left = max(0.0, self._deadline - time.monotonic())
            self._mine = bool(self._turn.lock.acquire(timeout=left))
        except BaseException:
            self._turn._leave()
            raise
        return self._mine

    def __exit__(self, *exc: object) -> None:
        try:
            if self._mine:
                self._turn.lock.release()
        finally:
            self._turn._leave()


def _forget_turns_in_child() -> None:
    # A forked child inherits the turns of threads that do not exist in it (their locks held
    # for ever): start afresh.
    Turn._mutex = threading.Lock()
    Turn._registry = {}


os.register_at_fork(after_in_child=_forget_turns_in_child)


def next_delay(retry_delay: float, retry_in: float | None, push: bool) -> float:
    """How long a waiter sleeps before its next attempt.

    With push wake-ups a release wakes the waiter at once, so it only needs to look again when
    the holder's lock would expire on its own. Without them it polls every `retry_delay` (with
    jitter so waiters spread out), and never sleeps past the holder's expiry.
    """
    if push and retry_in is not None:
        return retry_in * random.uniform(1.0, 1.1) + 0.001
    delay = retry_delay * random.uniform(0.5, 1.5)
    if retry_in is not None:
        delay = min(delay, retry_in + 0.001)
    return delay
