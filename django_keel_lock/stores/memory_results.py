"""Idempotent results of a `MemoryLockStore`: a dict, for tests and single-process programs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime

from .base import LockStore
from .results import ResultStore, StoredResult


class MemoryResults(ResultStore):
    """Results in a dict guarded by a mutex, expiring by the monotonic clock."""

    def __init__(self, store: LockStore) -> None:
        self.store = store
        self._mutex = threading.Lock()
        self._kept: dict[str, tuple[StoredResult, float]] = {}  # key -> (result, expires at)

    def _live(self, key: str) -> StoredResult | None:
        found = self._kept.get(key)
        if found is None:
            return None
        if found[1] <= time.monotonic():
            del self._kept[key]
            return None
        return found[0]

    def get(self, key: str) -> StoredResult | None:
        with self._mutex:
            return self._live(key)

    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        with self._mutex:
            # The lock store's own mutex is not ours: a takeover may land between this read
            # and the write, and then the fence comparison keeps the later holder's result.
            info = self.store.get(key)
            if info is None or info.owner != owner:
                return False
            current = self._live(key)
            if current is not None and current.fence >= fence:
                return False
            kept = replace(result, key=key, fence=fence, created_at=datetime.now(UTC))
            self._kept[key] = (kept, time.monotonic() + ttl)
            return True

    def forget(self, key: str) -> bool:
        with self._mutex:
            return self._kept.pop(key, None) is not None

    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        with self._mutex:
            keys = sorted(key for key in self._kept if key.startswith(prefix))
            found = [self._live(key) for key in keys]
        yield from (result for result in found if result is not None)
