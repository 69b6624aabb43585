"""Where idempotent results live: a `ResultStore` beside each lock store.

An idempotent request (`django_keel_lock.idempotency`) runs under the lock of its key and keeps
what it answered under the same key, in the store that holds the lock: a table beside the lock
table, keys beside the lock's in Redis, a dict in memory. The write is fenced: it is made only
while the writer still holds the key's lock, and never over a result of a later fence, so a
holder whose lock expired cannot overwrite what the one that took over kept.

A store of another package provides one with a method `result_store(self) -> ResultStore`
(see `idempotency.storage.result_store_for`).

A request reads and keeps its result in the store operation that releases its lock where the
store can (`get_releasing`, `save_releasing`): one round trip each, so that an idempotent
request costs one more than the same view under `lock_view`, and a replay one less.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

#: A lock store's exclusive release, `release(key, owner) -> released`.
Release = Callable[[str, str], bool]


@dataclass(frozen=True)
class StoredResult:
    """One kept result: what a request answered (`status` > 0) or a function returned (0)."""

    key: str
    fingerprint: str
    fence: int
    status: int
    data: bytes
    created_at: datetime | None = None  # by the store's clock, where it keeps one

    @property
    def size(self) -> int:
        return len(self.data)


class ResultStore(ABC):
    """Results kept for `ttl` seconds, each under the key of the lock its writer held."""

    @abstractmethod
    def get(self, key: str) -> StoredResult | None:
        """The live result kept under `key`, or None."""

    @abstractmethod
    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        """Keep `result` under `key` for `ttl` seconds if `owner` still holds the lock on `key`
        and no result of a fence >= `fence` is kept there, as one atomic step; True if kept."""

    def get_releasing(
        self, key: str, owner: str, release: Release
    ) -> tuple[StoredResult | None, bool | None]:
        """The live result kept under `key`, and when there is one, the lock `owner` holds
        on `key` released (`release` is the lock store's): (result, released), released None
        when there is no result (the lock is left held).

        This default makes two calls, `get` then `release`; a store that can do both in
        one round trip overrides it."""
        found = self.get(key)
        return found, None if found is None else release(key, owner)

    def save_releasing(
        self, key: str, owner: str, fence: int, result: StoredResult, ttl: float, release: Release
    ) -> tuple[bool, bool]:
        """`save`, and the lock `owner` holds on `key` released (`release`, the lock
        store's): (kept, released); neither without the lock.

        This default makes two calls, `save` then `release`; a store that can do both in
        one round trip, atomically, overrides it."""
        kept = self.save(key, owner, fence, result, ttl)
        return kept, release(key, owner)

    @abstractmethod
    def forget(self, key: str) -> bool:
        """Delete the result under `key`; True if there was one."""

    @abstractmethod
    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        """The live results whose key starts with `prefix`, in key order where the store
        can (Redis lists them as SCAN finds them)."""

    def prune(self) -> int:
        """Delete expired results the store keeps; how many (0 where they expire by themselves)."""
        return 0
