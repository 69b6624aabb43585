"""A per-process store: thread-safe, monotonic clock. For tests and single-process programs."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .base import AcquireResult, LockInfo, LockStore


@dataclass
class _Entry:
    owner: str
    holder: str
    fence: int
    acquired_at: float  # monotonic
    expires_at: float  # monotonic


class MemoryLockStore(LockStore):
    """Locks in a dict guarded by a mutex. Coordinates threads of one process only."""

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        self._mutex = threading.Lock()
        self._locks: dict[str, _Entry] = {}
        # One counter for every key: strictly increasing per key, and nothing to forget on prune.
        self._fences = itertools.count(1)
        # Wall-clock anchor so acquired_at can be shown as a datetime.
        self._wall_offset = time.time() - time.monotonic()

    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        now = time.monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is not None and entry.expires_at > now:
                if entry.owner != owner:
                    return AcquireResult(None, entry.expires_at - now)
                # The same owner asking again gets its acquisition back, ttl renewed, as the
                # contract asks of every store (there, a retry after a lost reply).
                entry.expires_at = now + ttl
                return AcquireResult(entry.fence)
            fence = next(self._fences)
            self._locks[key] = _Entry(owner, holder, fence, now, now + ttl)
        return AcquireResult(fence)

    def release(self, key: str, owner: str) -> bool:
        now = time.monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry.owner != owner or entry.expires_at <= now:
                return False
            del self._locks[key]
        self.wake_board.wake(key)
        return True

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        now = time.monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry.owner != owner or entry.expires_at <= now:
                return False
            entry.expires_at = max(entry.expires_at, now + ttl)
            return True

    def get(self, key: str) -> LockInfo | None:
        now = time.monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry.expires_at <= now:
                return None
            return self._info(key, entry, now)

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        now = time.monotonic()
        with self._mutex:
            items = [(k, e) for k, e in self._locks.items() if k.startswith(prefix)]
        for key, entry in sorted(items, key=lambda item: item[0]):
            if entry.expires_at > now:
                yield self._info(key, entry, now)

    def prune(self) -> int:
        now = time.monotonic()
        with self._mutex:
            dead = [k for k, e in self._locks.items() if e.expires_at <= now]
            for key in dead:
                del self._locks[key]
        return len(dead)

    @property
    def push_wakeups(self) -> bool:
        return True  # every holder lives in this process, so every release wakes directly

    def _info(self, key: str, entry: _Entry, now: float) -> LockInfo:
        acquired = datetime.fromtimestamp(entry.acquired_at + self._wall_offset, tz=UTC)
        return LockInfo(
            key=key,
            owner=entry.owner,
            holder=entry.holder,
            fence=entry.fence,
            acquired_at=acquired,
            expires_in=max(0.0, entry.expires_at - now),
        )

    def advance_clock(self, seconds: float) -> None:
        """Age every lock by `seconds`: lets a test see expiry without sleeping."""
        with self._mutex:
            for entry in self._locks.values():
                entry.expires_at -= seconds
                entry.acquired_at -= seconds
