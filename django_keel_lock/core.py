"""The Lock handle: the one place that knows how waiting, ownership and fencing work.

Every surface (context manager, view decorator, management command, admin, Celery) goes
through `Lock`; stores below only answer atomic questions (see `stores.base.LockStore`).

The sync and async methods share every decision (`_wait_args`, `_begin`, `_finish`,
`_released`, `_extend_args`, `_extended`, `next_delay`); they differ only in how they wait and
call the store. The async ones are cancellation-safe: a store call they start always runs to
its end (`_to_the_end`), so a cancellation never strands a lock nor skips a release.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar, overload

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core import signing
from django.dispatch import Signal

from . import signals, watchdog
from .conf import conf, get_lock_store
from .durations import Duration, to_seconds
from .exceptions import InvalidLockToken, LockError, LockNotHeldError, LockUnavailable
from .stores.base import AcquireResult, LockInfo, LockStore

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")

DEFAULT_RETRY_DELAY = 0.05
TOKEN_SALT = "django_keel_lock.token"
MAX_HOLDER_LENGTH = 255
# Longer ttls would overflow some stores' interval arithmetic; a lock that must outlive a
# year wants a human, not a ttl.
MAX_TTL = 365 * 86400.0
_HOSTNAME = socket.gethostname()


class LockOutcome(NamedTuple, Generic[T]):
    """What `Lock.run` did: `acquired` is False when fn was not called (then `value` is None)."""

    acquired: bool
    value: T | None


def default_holder() -> str:
    """`<hostname>:<pid>`, computed now so a forked child names itself."""
    return f"{_HOSTNAME}:{os.getpid()}"


def validate_key(key: object, store: LockStore | None = None) -> str:
    """Return `key` if it is a usable lock key, else raise naming the argument."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("key must be a non-empty string")
    if "\x00" in key:
        raise ValueError("key must not contain NUL characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"key must be encodable as UTF-8 ({exc.reason})") from None
    limit = store.max_key_length if store is not None else None
    if limit is not None and len(key) > limit:
        raise ValueError(
            f"key is {len(key)} characters long; store {store.alias!r} "  # type: ignore[union-attr]
            f"accepts at most {limit}"
        )
    return key


KeyTemplate = str | Callable[..., str]


def format_key(
    template: KeyTemplate, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key for one call of `fn`: `template` formatted with the call's bound arguments
    ("report:{date}", "{self.pk}" works too), or `template(*args, **kwargs)` if callable.

    The one key formatter every decorator (locked, locked_task) uses.
    """
    if callable(template):
        return validate_key(template(*args, **kwargs))
    if not isinstance(template, str):
        raise TypeError(f"key must be a str template or a callable, got {type(template).__name__}")
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"cannot bind arguments of {fn.__qualname__} for key {template!r}: {exc}"
        ) from None
    bound.apply_defaults()
    try:
        return validate_key(template.format(**bound.arguments))
    except (KeyError, AttributeError, IndexError) as exc:
        names = ", ".join(bound.arguments) or "none"
        raise ValueError(
            f"key template {template!r} names {exc} which {fn.__qualname__} does not have "
            f"(its arguments: {names})"
        ) from None


def ttl_seconds(ttl: object) -> float:
    """`ttl` as seconds: a duration > 0 and at most a year, else an error naming "ttl"."""
    seconds = to_seconds("ttl", ttl)
    if seconds > MAX_TTL:
        raise ValueError(f"ttl must be at most {MAX_TTL:g} seconds (a year), got {ttl!r}")
    return seconds


class LockOptions(NamedTuple):
    """The checked, parsed options of one lock (seconds; ttl None when left to the default)."""

    ttl: float | None
    timeout: float
    retry_delay: float
    max_hold: float | None


def check_options(
    *,
    ttl: Duration | None,
    timeout: Duration,
    retry_delay: Duration,
    store: object,
    auto_extend: object = False,
    max_hold: Duration | None = None,
) -> LockOptions:
    """Parse what lock() takes besides key and holder; a bad value raises naming it.

    `Lock` uses it, and so do the decorators, so a mistake fails when a function is decorated
    rather than on its first call (ttl None: the default, not looked at here)."""
    if not isinstance(store, str):
        raise TypeError(f"store must be an alias (str), got {type(store).__name__}")
    if not isinstance(auto_extend, bool):
        raise TypeError(f"auto_extend must be True or False, got {auto_extend!r}")
    hold = None if max_hold is None else to_seconds("max_hold", max_hold)
    if hold is not None and not auto_extend:
        raise ValueError(
            "max_hold caps how long auto_extend keeps a lock alive; pass auto_extend=True "
            "with it, or drop max_hold"
        )
    return LockOptions(
        ttl=None if ttl is None else ttl_seconds(ttl),
        timeout=to_seconds("timeout", timeout, allow_zero=True),
        retry_delay=to_seconds("retry_delay", retry_delay, allow_zero=True),
        max_hold=hold,
    )


def _validate_holder(holder: object) -> str:
    if not isinstance(holder, str):
        raise TypeError(f"holder must be a str, got {type(holder).__name__}")
    if not holder or len(holder) > MAX_HOLDER_LENGTH or "\x00" in holder:
        raise ValueError(
            f"holder must be 1 to {MAX_HOLDER_LENGTH} characters without NUL, got {holder!r:.80}"
        )
    try:
        holder.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holder must be encodable as UTF-8 ({exc.reason})") from None
    return holder


async def _to_the_end(
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


class _Turn:
    """Waiters for one key take turns: only the one whose turn it is tries the store and
    listens for releases (tasks in the order they came; threads as the OS wakes them). One turn
    per key for the threads of the process, and one per key for the tasks of each event loop.

    Without it every release would wake every waiter into a store round trip at once (200
    waiters: 200 calls per release, a pool's worth of connections at a time).
    """

    _mutex = threading.Lock()  # the registry is shared by every thread and loop of the process
    _registry: dict[tuple[asyncio.AbstractEventLoop | None, LockStore, str], _Turn] = {}

    def __init__(self, name: tuple[asyncio.AbstractEventLoop | None, LockStore, str]) -> None:
        self.name = name
        self.lock: Any = threading.Lock() if name[0] is None else asyncio.Lock()
        self.members = 0

    @classmethod
    def _join(cls, loop: asyncio.AbstractEventLoop | None, store: LockStore, key: str) -> _Turn:
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
    @contextmanager
    def wait_for(cls, store: LockStore, key: str, deadline: float) -> Iterator[bool]:
        """A thread's turn at `key`: True once it is ours (until the block ends), False if it
        did not come by `deadline` (monotonic)."""
        turn = cls._join(None, store, key)
        try:
            mine = turn.lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            try:
                yield bool(mine)
            finally:
                if mine:
                    turn.lock.release()
        finally:
            turn._leave()

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


def _forget_turns_in_child() -> None:
    # A forked child inherits the turns of threads that do not exist in it (their locks held
    # for ever): start afresh.
    _Turn._mutex = threading.Lock()
    _Turn._registry = {}


os.register_at_fork(after_in_child=_forget_turns_in_child)


def announce(signal: Signal, **kwargs: Any) -> None:
    """Send one of our signals. A receiver that raises is logged (by Django, logger
    "django.dispatch"), not propagated: it must not strand an acquired lock nor cut a release
    short."""
    if signal.receivers:
        signal.send_robust(sender=Lock, **kwargs)


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


class Lock:
    """A handle on one key in one store. Not shared between threads: make one per worker.

    A handle acquires at most once at a time; each acquisition gets a fresh random `owner`
    token and a `fence` strictly greater than every earlier fence of the key in that store.
    """

    def __init__(
        self,
        key: str,
        *,
        ttl: Duration | None = None,
        timeout: Duration = 0,
        retry_delay: Duration = DEFAULT_RETRY_DELAY,
        store: str = "default",
        holder: str | None = None,
        auto_extend: bool = False,
        max_hold: Duration | None = None,
    ) -> None:
        options = check_options(
            ttl=conf.DEFAULT_TTL if ttl is None else ttl,
            timeout=timeout,
            retry_delay=retry_delay,
            store=store,
            auto_extend=auto_extend,
            max_hold=max_hold,
        )
        self._store = get_lock_store(store)
        self.key = validate_key(key, self._store)
        self.ttl = options.ttl or 0.0  # never None here: a ttl was given
        self.timeout, self.retry_delay = options.timeout, options.retry_delay
        self.holder = default_holder() if holder is None else _validate_holder(holder)
        self.auto_extend, self.max_hold = auto_extend, options.max_hold
        self.store_alias = store
        self.owner: str | None = None
        self._next_owner: str | None = None
        self.fence: int | None = None
        #: True once this acquisition is known lost (expired, taken over, store unreachable).
        self.lost = False
        self._held = False
        self._acquired_at = 0.0  # monotonic, when the acquiring call was sent
        self._valid_until = math.inf  # monotonic, the last expiry the store confirmed
        self._renewal: watchdog.Renewal | None = None
        self._mutex = threading.Lock()  # state shared with the watchdog

    # -- acquiring ------------------------------------------------------------------------
    def acquire(self, timeout: Duration | None = None, retry_delay: Duration | None = None) -> bool:
        """Take the lock, waiting up to `timeout` seconds (default: the handle's, 0 = no wait).

        True if acquired. Raises LockStoreUnavailable if the store cannot be reached.
        """
        wait, delay = self._wait_args(timeout, retry_delay)
        owner = self._begin()
        if wait <= 0:
            sent = time.monotonic()
            result = self._store.acquire(self.key, owner, self.holder, self.ttl)
        else:
            result, sent = self._wait(owner, wait, delay)
        if not self._finish(owner, result, sent):
            return False
        if self.auto_extend:
            self._renewal = watchdog.start_thread(self)
        return True

    def _wait_args(
        self, timeout: Duration | None, retry_delay: Duration | None
    ) -> tuple[float, float]:
        wait = self.timeout if timeout is None else to_seconds("timeout", timeout, allow_zero=True)
        delay = (
            self.retry_delay
            if retry_delay is None
            else to_seconds("retry_delay", retry_delay, allow_zero=True)
        )
        return wait, delay

    def _begin(self) -> str:
        if self._held:
            raise LockError(
                f"this handle already holds {self.key!r}; release it first or make a new handle"
            )
        # The owner stays the same for every attempt until one succeeds: an attempt whose
        # reply was lost (timeout, dropped connection) may still have taken the lock, and a
        # retry with the same owner gets it back instead of stranding it until its ttl.
        if self._next_owner is None:
            self._next_owner = secrets.token_hex(16)
        return self._next_owner

    def _finish(self, owner: str, result: AcquireResult, sent: float) -> bool:
        """Take on the outcome of an acquire attempt sent at monotonic time `sent`."""
        if result.fence is None:
            logger.debug("lock %r is held by someone else", self.key)
            return False
        with self._mutex:
            self.owner, self.fence, self._held, self.lost = owner, result.fence, True, False
            self._next_owner = None
            # The store started the ttl after we sent the call: counting from `sent` errs early.
            self._acquired_at, self._valid_until = sent, sent + self.ttl
        announce(signals.lock_acquired, lock=self)
        return True

    def _wait(self, owner: str, timeout: float, retry_delay: float) -> tuple[AcquireResult, float]:
        store = self._store
        deadline = time.monotonic() + timeout
        with _Turn.wait_for(store, self.key, deadline) as mine:
            if not mine:
                return AcquireResult(None), time.monotonic()
            with store.watch(self.key) as waiter:
                while True:
                    sent = time.monotonic()
                    result = store.acquire(self.key, owner, self.holder, self.ttl)
                    left = deadline - time.monotonic()
                    if result.fence is not None or left <= 0:
                        return result, sent
                    push = store.push_wakeups
                    waiter.wait(min(left, next_delay(retry_delay, result.retry_in, push)))

    # -- acquiring, async -----------------------------------------------------------------
    async def aacquire(
        self, timeout: Duration | None = None, retry_delay: Duration | None = None
    ) -> bool:
        """`acquire` for async code: waits without blocking the event loop.

        Cancelled while waiting or while an attempt is in flight, it leaves no lock behind."""
        wait, delay = self._wait_args(timeout, retry_delay)
        owner = self._begin()
        if wait <= 0:
            result, sent = await self._aattempt(owner)
        else:
            result, sent = await self._await(owner, wait, delay)
        if not self._finish(owner, result, sent):
            return False
        if self.auto_extend:
            self._renewal = watchdog.start_task(self)
        return True

    async def _aattempt(self, owner: str) -> tuple[AcquireResult, float]:
        """One acquire attempt; if cancelled meanwhile, give back what it took, then re-raise."""
        store = self._store
        sent = time.monotonic()
        future, cancelled = await _to_the_end(
            store.aacquire(self.key, owner, self.holder, self.ttl)
        )
        if cancelled is not None:
            if not future.cancelled() and future.exception() is None and future.result().acquired:
                undo, _ = await _to_the_end(store.arelease(self.key, owner))
                if undo.cancelled() or undo.exception() is not None:
                    logger.warning(
                        "lock %r was acquired as its waiter was cancelled and could not be given "
                        "back; it expires in %gs",
                        self.key,
                        self.ttl,
                    )
            raise cancelled
        return future.result(), sent

    async def _await(
        self, owner: str, timeout: float, retry_delay: float
    ) -> tuple[AcquireResult, float]:
        store = self._store
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # called from whichever thread saw the release
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the loop is closed; nobody is waiting any more
                pass

        deadline = time.monotonic() + timeout
        async with _Turn.await_for(store, self.key, deadline) as mine:
            if not mine:
                return AcquireResult(None), time.monotonic()
            # watch() starts the store's cross-process listener; the callback is how an
            # async waiter hears of releases: it cannot block on the Waiter's condition.
            with store.watch(self.key):
                token = store.wake_board.add_callback(self.key, wake)
                try:
                    while True:
                        woken.clear()  # before the attempt: a release right after counts
                        result, sent = await self._aattempt(owner)
                        left = deadline - time.monotonic()
                        if result.fence is not None or left <= 0:
                            return result, sent
                        pause = next_delay(retry_delay, result.retry_in, store.push_wakeups)
                        try:
                            async with asyncio.timeout(min(left, pause)):
                                await woken.wait()
                        except TimeoutError:
                            pass
                finally:
                    store.wake_board.remove_callback(token)

    # -- holding --------------------------------------------------------------------------
    def release(self) -> bool:
        """Free the lock if we still own it. False if it had expired or was taken over.

        On LockStoreUnavailable the handle keeps its owner, so release can be called again
        (the watchdog, if any, has stopped: the lock then lives until its ttl at most).
        """
        if not self._held or self.owner is None:
            return False
        self._stop_renewal()
        return self._released(self._store.release(self.key, self.owner))

    def _released(self, released: bool) -> bool:
        self._held = False
        if released:
            announce(signals.lock_released, lock=self)
        else:
            self._lost("release found the lock expired or taken over")
        return released

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lock live at least `ttl` more seconds (default: the lock's ttl).

        Raises LockNotHeldError if the lock was lost; the handle then no longer holds it.
        """
        seconds, owner = self._extend_args(ttl)
        sent = time.monotonic()
        self._extended(self._store.extend(self.key, owner, seconds), sent + seconds)

    def _extend_args(self, ttl: Duration | None) -> tuple[float, str]:
        seconds = self.ttl if ttl is None else ttl_seconds(ttl)
        if not self._held or self.owner is None:
            raise LockNotHeldError(f"cannot extend {self.key!r}: this handle does not hold it")
        return seconds, self.owner

    def _extended(self, extended: bool, until: float) -> None:
        if extended:
            self._valid_until = max(self._valid_until, until)
            return
        self._held = False
        self._lost("extend found the lock expired or taken over")
        raise LockNotHeldError(
            f"cannot extend {self.key!r}: the lock expired or was taken over (fence {self.fence})"
        )

    def _confirmed(self, owner: str, until: float) -> None:
        """The watchdog's extend for `owner` landed: the lock lives at least until `until`."""
        with self._mutex:
            if self._held and self.owner == owner:
                self._valid_until = max(self._valid_until, until)

    def _lost(self, reason: str, owner: str | None = None) -> None:
        """Mark the current acquisition lost, once: `lost`, a WARNING and `lock_lost`.

        With `owner` (the watchdog reporting), only if that acquisition is still current."""
        with self._mutex:
            if self.lost or (owner is not None and (owner != self.owner or not self._held)):
                return
            self.lost, self._held = True, False
            # Taken under the mutex: once it is released the handle may acquire again, and
            # that acquisition's watchdog is not ours to stop.
            renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.stop()
        logger.warning("lock %r (fence %s) was lost: %s", self.key, self.fence, reason)
        announce(signals.lock_lost, lock=self, reason=reason)

    def _stop_renewal(self) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.stop()

    def ensure_held(self) -> None:
        """Raise LockNotHeldError unless this handle still holds its lock, as far as it knows.

        No store round trip: fails once released, lost, or past the last expiry confirmed."""
        if self._held and time.monotonic() >= self._valid_until:
            self._lost("its ttl ran out without a confirmed extend", owner=self.owner)
        if not self._held or self.owner is None:
            why = "it was lost" if self.lost else "this handle does not hold it"
            raise LockNotHeldError(f"lock {self.key!r} (fence {self.fence}) is not held: {why}")

    # -- holding, async -------------------------------------------------------------------
    async def arelease(self) -> bool:
        """`release` for async code; it completes even while the task is being cancelled.

        The cancellation is re-raised once the store has answered."""
        if not self._held or self.owner is None:
            return False
        self._stop_renewal()
        future, cancelled = await _to_the_end(self._store.arelease(self.key, self.owner))
        if cancelled is not None:
            if future.cancelled() or future.exception() is not None:
                logger.warning(
                    "release of lock %r failed while its task was cancelled; it expires in at "
                    "most %gs",
                    self.key,
                    self.ttl,
                )
            else:
                self._released(future.result())
            raise cancelled
        return self._released(future.result())

    async def aextend(self, ttl: Duration | None = None) -> None:
        """`extend` for async code. Raises LockNotHeldError if the lock was lost.

        Cancelled meanwhile, it still records what the store did, then re-raises."""
        seconds, owner = self._extend_args(ttl)
        sent = time.monotonic()
        future, cancelled = await _to_the_end(self._store.aextend(self.key, owner, seconds))
        if cancelled is not None:
            if not future.cancelled() and future.exception() is None:
                try:
                    self._extended(future.result(), sent + seconds)
                except LockNotHeldError:
                    pass
            raise cancelled
        self._extended(future.result(), sent + seconds)

    # -- inspection -----------------------------------------------------------------------
    def info(self) -> LockInfo | None:
        """The live lock on this key (ours or another holder's), or None if it is free."""
        return self._store.get(self.key)

    def is_locked(self) -> bool:
        """Does anyone (not necessarily this handle) hold the key right now?"""
        return self._store.get(self.key) is not None

    def is_expired(self) -> bool:
        """True when this handle acquired the lock and no longer holds it in the store."""
        if self.owner is None:
            return False
        info = self._store.get(self.key)
        return info is None or info.owner != self.owner

    def remaining_time(self) -> float | None:
        """Seconds until the key's current lock expires, None when nobody holds it."""
        info = self._store.get(self.key)
        return None if info is None else info.expires_in

    async def ainfo(self) -> LockInfo | None:
        """`info` for async code: the live lock on this key, or None if it is free."""
        return await self._store.aget(self.key)

    async def ais_locked(self) -> bool:
        """`is_locked` for async code: does anyone hold the key right now?"""
        return await self._store.aget(self.key) is not None

    async def ais_expired(self) -> bool:
        """`is_expired` for async code: acquired by this handle, no longer held in the store."""
        if self.owner is None:
            return False
        info = await self._store.aget(self.key)
        return info is None or info.owner != self.owner

    async def aremaining_time(self) -> float | None:
        """`remaining_time` for async code: seconds until the key's lock expires, or None."""
        info = await self._store.aget(self.key)
        return None if info is None else info.expires_in

    @property
    def held(self) -> bool:
        """Whether this handle believes it holds the lock (no store round trip)."""
        return self._held

    @property
    def store(self) -> LockStore:
        return self._store

    # -- running --------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]:
        """Acquire, call `fn()`, always release. `(False, None)` and fn not called if not
        acquired within `timeout`; store failures raise LockStoreUnavailable."""
        if not self.acquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        try:
            value = fn()
        finally:
            self.release()
        return LockOutcome(True, value)

    def run_immediately(self, fn: Callable[[], T]) -> LockOutcome[T]:
        """`run` that never waits: fn runs only if the lock is free right now."""
        return self.run(fn, timeout=0)

    # -- running, async ------------------------------------------------------------------
    @overload
    async def arun(  # type: ignore[overload-overlap]
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    @overload
    async def arun(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    async def arun(
        self,
        fn: Callable[[], Any],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[Any]:
        """`run` for async code: `fn` is an async callable, or a sync one run in a thread.

        The release completes even on cancellation; a sync fn cannot be interrupted, so on
        cancellation the lock is kept until it returns, then released, then the cancel raised."""
        if not await self.aacquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        try:
            value = await _call(fn)
        finally:
            await self.arelease()
        return LockOutcome(True, value)

    async def __aenter__(self) -> Lock:
        if not await self.aacquire():
            raise self._unavailable()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.arelease()

    def _unavailable(self) -> LockUnavailable:
        return LockUnavailable(
            self.key, f"lock {self.key!r} is held by someone else (waited {self.timeout:g}s)"
        )

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise self._unavailable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # -- handing over ---------------------------------------------------------------------
    def serialize(self) -> str:
        """A signed token another process can pass to `restore_lock` to extend or release."""
        if self.owner is None or not self._held:
            raise LockNotHeldError(f"cannot serialize {self.key!r}: this handle does not hold it")
        payload = {
            "k": self.key,
            "t": self.ttl,
            "o": self.owner,
            "f": self.fence,
            "h": self.holder,
            "s": self.store_alias,
        }
        return signing.dumps(payload, salt=TOKEN_SALT, compress=True)

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "not held"
        return f"<Lock {self.key!r} store={self.store_alias!r} {state}>"


def lock(
    key: str,
    *,
    ttl: Duration | None = None,
    timeout: Duration = 0,
    retry_delay: Duration = DEFAULT_RETRY_DELAY,
    store: str = "default",
    holder: str | None = None,
    auto_extend: bool = False,
    max_hold: Duration | None = None,
) -> Lock:
    """A handle on `key` in `store`; nothing is acquired until acquire/run/`with`.

    `auto_extend=True` keeps the lock alive while held (extending every ttl/3), for at most
    `max_hold` seconds in all if given."""
    return Lock(
        key,
        ttl=ttl,
        timeout=timeout,
        retry_delay=retry_delay,
        store=store,
        holder=holder,
        auto_extend=auto_extend,
        max_hold=max_hold,
    )


async def _call(fn: Callable[[], Any]) -> Any:
    """Call `fn` from async code: await it if async, else run it in a worker thread.

    A thread cannot be interrupted: if cancelled meanwhile, wait for it, then re-raise."""
    if iscoroutinefunction(fn):
        return await fn()
    future, cancelled = await _to_the_end(sync_to_async(fn, thread_sensitive=False)())
    if cancelled is not None:
        raise cancelled
    value = future.result()
    if inspect.isawaitable(value):  # lambda: some_coroutine(...)
        value = await value
    return value


def restore_lock(token: str) -> Lock:
    """The handle `Lock.serialize` described, holding the same acquisition (same owner, fence).

    Raises InvalidLockToken for garbage, truncated, tampered or foreign tokens.
    """
    if not isinstance(token, str):
        raise InvalidLockToken(f"lock token must be a str, got {type(token).__name__}")
    try:
        data = signing.loads(token, salt=TOKEN_SALT)
    except signing.BadSignature as exc:
        raise InvalidLockToken(
            "lock token is not valid: it was altered, truncated, or signed with another SECRET_KEY"
        ) from exc
    except Exception as exc:  # undecodable payload behind a valid signature cannot happen,
        raise InvalidLockToken(f"lock token could not be decoded: {exc}") from exc  # but be sure
    if not isinstance(data, dict) or not _token_shape_ok(data):
        raise InvalidLockToken("lock token is signed but does not describe a lock")
    handle = Lock(data["k"], ttl=data["t"], store=data["s"], holder=data["h"])
    handle.owner, handle.fence, handle._held = data["o"], data["f"], True
    return handle


def _token_shape_ok(data: dict[str, Any]) -> bool:
    types: dict[str, type | tuple[type, ...]] = {
        "k": str,
        "t": (int, float),
        "o": str,
        "f": int,
        "h": str,
        "s": str,
    }
    return all(isinstance(data.get(name), kind) for name, kind in types.items())


def force_release(
    key: str, *, store: str = "default", user: object | None = None, fence: int | None = None
) -> LockInfo | None:
    """Free `key` in the store `store` whoever holds it; the lock that was freed, or None.
    With `fence`, only that acquisition: one taken over since (say, while a person was asked
    to confirm) is left alone.

    The one force release behind `manage.py locks release` and the admin: it logs a WARNING when
    it frees a lock and always sends `lock_force_released` (info=None: nothing was held).
    """
    if not isinstance(store, str):
        raise TypeError(f"store must be an alias (str), got {type(store).__name__}")
    lock_store = get_lock_store(store)
    validate_key(key, lock_store)
    info = lock_store.force_release(key, fence)
    if info is not None:
        logger.warning(
            "lock %r in store %r (holder %s, fence %s) was force-released by %s",
            key,
            store,
            info.holder,
            info.fence,
            user if user is not None else "a script",
        )
    announce(signals.lock_force_released, key=key, store=store, info=info, user=user)
    return info
