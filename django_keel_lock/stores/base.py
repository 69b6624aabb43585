"""The LockStore protocol every store implements, and the data it answers with.

A store is a dumb, atomic key/owner table with expiry: it never waits, never retries and never
decides policy. Waiting, ownership tokens and fencing rules live in `django_keel_lock.core`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

from ..conf import validate_store_options
from .wakeups import WakeBoard

T = TypeVar("T")
_executor_mutex = threading.Lock()


@dataclass(frozen=True)
class LockInfo:
    """One held lock as a store sees it at the moment it was read."""

    key: str
    owner: str
    holder: str
    fence: int
    acquired_at: datetime | None
    expires_in: float  # seconds left, by the store's own clock


class AcquireResult(NamedTuple):
    """What one acquire attempt gave: a fence when acquired, else how long the holder has left."""

    fence: int | None
    retry_in: float | None = None  # seconds until the current holder's lock expires, if known

    @property
    def acquired(self) -> bool:
        return self.fence is not None


class LockStore(ABC):
    """Where locks live. Every operation is atomic on the store's side and never waits.

    Times are seconds (float). Expiry is judged by the store's own clock, never the caller's.
    Any failure to reach the store raises `LockStoreUnavailable`, never a "not acquired".
    """

    #: Longest key this store accepts (None: no limit of its own).
    max_key_length: int | None = None
    #: Known options (upper-case names in KEEL_LOCK_STORES[alias]["OPTIONS"]).
    option_names: frozenset[str] = frozenset()
    #: True when the server itself deletes a lock once it expires (Redis key TTLs): `prune()`
    #: then has nothing to do, and `locks prune` says so rather than "pruned 0".
    expires_by_itself: bool = False

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        self.alias = alias
        self.options = dict(options or {})
        validate_store_options(alias, type(self), self.options)
        self.wake_board = WakeBoard()

    # -- the atomic operations ------------------------------------------------------------
    @abstractmethod
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        """Take `key` for `owner` if it is free or expired, with a fence greater than any this
        store gave `key` before. Otherwise report how long the holder has left."""

    @abstractmethod
    def release(self, key: str, owner: str) -> bool:
        """Free `key` if `owner` still holds it (and it has not expired); True if it did."""

    @abstractmethod
    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Make `owner`'s lock live at least `ttl` more seconds; False if `owner` lost it."""

    @abstractmethod
    def get(self, key: str) -> LockInfo | None:
        """The live lock on `key`, or None when it is free or expired."""

    def force_release(self, key: str, fence: int | None = None) -> LockInfo | None:
        """Free `key` whoever holds it (only the acquisition with `fence`, if given); the lock
        that was freed, or None if none (or another acquisition) was held.

        Reads the holder, then releases as that owner: a lock taken over in between is left
        alone, so what is reported is exactly what was freed.
        """
        for _ in range(3):
            info = self.get(key)
            if info is None or (fence is not None and info.fence != fence):
                return None
            if self.release(key, info.owner):
                return info
        return None

    @abstractmethod
    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Stream the live locks whose key starts with `prefix`, without loading all at once."""

    def prune(self) -> int:
        """Delete expired entries the store keeps; how many. Stores that expire by themselves
        (`expires_by_itself`) return 0."""
        return 0

    # -- waiting --------------------------------------------------------------------------
    @property
    def push_wakeups(self) -> bool:
        """True while every release, in any process, reaches this process's waiters promptly;
        then a waiter needs to poll only for a holder that expires without releasing."""
        return False

    def watch(self, key: str) -> Any:
        """Context manager yielding a `Waiter` for `key`. Stores with a cross-process listener
        start it here."""
        return self.wake_board.watch(key)

    def close(self) -> None:
        """Release connections and stop listeners; the store may be used again afterwards."""

    # -- worker threads -------------------------------------------------------------------
    #: Threads that run sync operations for async callers and the watchdog (the size of
    #: asyncio's default executor).
    worker_threads = min(32, (os.cpu_count() or 1) + 4)
    _executor: ThreadPoolExecutor | None = None
    _executor_pid = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on this store's own worker threads, made once per process.

        Not asyncio's executor: that one lives and dies with each event loop, and a connection
        a store opens per thread would outlive its thread; these threads live as long as the
        store, so the connections they open stay few and are reused.
        """
        executor = self._executor
        if executor is None or self._executor_pid != os.getpid():
            with _executor_mutex:
                executor = self._executor
                if executor is None or self._executor_pid != os.getpid():
                    executor = self._executor = ThreadPoolExecutor(
                        self.worker_threads, thread_name_prefix=f"keel-lock-{self.alias}"
                    )
                    self._executor_pid = os.getpid()
        return executor.submit(fn, *args)

    # -- async ----------------------------------------------------------------------------
    # Defaults run the sync operation on the store's worker threads; stores with a native
    # async client (Redis) override them. The core makes them cancellation-safe, not the store.
    async def aacquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return await asyncio.wrap_future(self.submit(self.acquire, key, owner, holder, ttl))

    async def arelease(self, key: str, owner: str) -> bool:
        return await asyncio.wrap_future(self.submit(self.release, key, owner))

    async def aextend(self, key: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(self.submit(self.extend, key, owner, ttl))

    async def aget(self, key: str) -> LockInfo | None:
        return await asyncio.wrap_future(self.submit(self.get, key))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"
