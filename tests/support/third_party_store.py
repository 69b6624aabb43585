"""A store written the way docs/writing-a-store.md tells a third party to: a LockStore subclass
on a dict, with its own clock. tests/test_third_party_store.py runs the contract suite against
it through KEEL_LOCK_CONTRACT_STORE, and against `ReleasesForAnyone`, which must fail it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.checks import CheckMessage, Warning

from django_keel_lock.stores import AcquireResult, LockInfo, LockStore


class DictLockStore(LockStore):
    """Locks in a dict of key -> (owner, holder, fence, acquired_at, expires_at), guarded by
    a mutex: one process only. OPTIONS MAX_KEY_LENGTH caps keys (so the suite's options
    reach it: KEEL_LOCK_CONTRACT_OPTIONS)."""

    option_names = frozenset({"MAX_KEY_LENGTH"})

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        self.max_key_length = self.options.get("MAX_KEY_LENGTH")
        self._mutex = threading.Lock()
        self._locks: dict[str, tuple[str, str, int, float, float]] = {}
        # The last fence each key got. Kept when a lock is released or pruned: a key's fences
        # must keep increasing across both.
        self._fences: dict[str, int] = {}

    def now(self) -> float:
        """The store's clock, the only one that judges expiry (never the caller's)."""
        return time.monotonic()

    def _live(self, key: str, now: float) -> tuple[str, str, int, float, float] | None:
        entry = self._locks.get(key)
        return entry if entry is not None and entry[4] > now else None

    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        with self._mutex:
            now = self.now()
            entry = self._live(key, now)
            if entry is not None and entry[0] == owner:
                return AcquireResult(entry[2])  # a retry after a lost reply gets its lock back
            if entry is not None:
                return AcquireResult(None, entry[4] - now)
            fence = self._fences[key] = self._fences.get(key, 0) + 1
            self._locks[key] = (owner, holder, fence, now, now + ttl)
            return AcquireResult(fence)

    def release(self, key: str, owner: str) -> bool:
        with self._mutex:
            entry = self._live(key, self.now())
            if entry is None or entry[0] != owner:
                return False
            del self._locks[key]
        self.wake_board.wake(key)
        return True

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        with self._mutex:
            now = self.now()
            entry = self._live(key, now)
            if entry is None or entry[0] != owner:
                return False
            self._locks[key] = (*entry[:4], max(entry[4], now + ttl))
            return True

    def get(self, key: str) -> LockInfo | None:
        with self._mutex:
            now = self.now()
            entry = self._live(key, now)
            return None if entry is None else self._info(key, entry, now)

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        with self._mutex:
            now = self.now()
            found = [
                self._info(key, entry, now)
                for key, entry in sorted(self._locks.items())
                if key.startswith(prefix) and entry[4] > now
            ]
        yield from found

    def prune(self) -> int:
        with self._mutex:
            now = self.now()
            dead = [key for key, entry in self._locks.items() if entry[4] <= now]
            for key in dead:
                del self._locks[key]
        return len(dead)

    def _info(self, key: str, entry: tuple[str, str, int, float, float], now: float) -> LockInfo:
        owner, holder, fence, acquired_at, expires_at = entry
        acquired = datetime.now(UTC) - timedelta(seconds=now - acquired_at)
        return LockInfo(key, owner, holder, fence, acquired, expires_at - now)


class ReleasesForAnyone(DictLockStore):
    """A broken store: release frees the key whoever asks. The contract suite must fail it."""

    def release(self, key: str, owner: str) -> bool:
        with self._mutex:
            if self._live(key, self.now()) is None:
                return False
            del self._locks[key]
        self.wake_board.wake(key)
        return True


class CheckedDictLockStore(DictLockStore):
    """DictLockStore with system checks and an admin note of its own, as docs/writing-a-store.md
    shows: OPTIONS REGION is expected (`manage.py check`), and `check --database` says once,
    naming every alias of it, that there is no server to ask."""

    option_names = DictLockStore.option_names | {"REGION"}
    admin_note = "Locks of a dict in this web server process."

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        if "REGION" in options:
            return []
        return [
            Warning(
                f"KEEL_LOCK_STORES[{alias!r}] names no REGION.",
                hint="Set OPTIONS REGION.",
                id="dict_store.W001",
            )
        ]

    @classmethod
    def check_servers(
        cls, stores: Mapping[str, Mapping[str, Any]], *, databases: Sequence[str]
    ) -> list[CheckMessage]:
        named = ", ".join(repr(alias) for alias in stores)
        return [Warning(f"Dict stores {named} have no server to ask.", id="dict_store.W002")]
