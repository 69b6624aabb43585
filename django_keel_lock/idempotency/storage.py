"""Which `ResultStore` keeps the idempotent results of a lock store, reading and keeping a
result in the operation that releases the key's lock, and running a step once the caller's
transactions have committed."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from django.db import connections, transaction

from ..exceptions import LockStoreMisconfigured
from ..registry import get_lock_store
from ..stores.base import LockStore
from ..stores.results import ResultStore, StoredResult

if TYPE_CHECKING:
    from ..core import Lock

_cache: weakref.WeakKeyDictionary[LockStore, ResultStore] = weakref.WeakKeyDictionary()
_mutex = threading.Lock()


def result_store_for(alias: str) -> ResultStore:
    """The `ResultStore` beside the lock store `alias`: the store's own `result_store()` if it
    has one (a store of another package), else the built-in one for its kind; one per store."""
    store = get_lock_store(alias)
    with _mutex:
        found = _cache.get(store)
        if found is None:
            found = _cache[store] = _make(store)
        return found


def _make(store: LockStore) -> ResultStore:
    own = getattr(store, "result_store", None)
    if callable(own):
        made = own()
        if not isinstance(made, ResultStore):
            raise LockStoreMisconfigured(
                f"{type(store).__name__}.result_store() must return a "
                f"django_keel_lock.stores.results.ResultStore, got {type(made).__name__}"
            )
        return made
    # Imported here: each pulls in its store's driver and models only when used.
    from ..stores.database.store import DatabaseLockStore
    from ..stores.memory import MemoryLockStore

    if isinstance(store, DatabaseLockStore):
        from ..stores.database.results import DatabaseResults

        return DatabaseResults(store)
    if isinstance(store, MemoryLockStore):
        from ..stores.memory_results import MemoryResults

        return MemoryResults(store)
    if any(k.__module__.startswith("django_keel_lock.stores.redis") for k in type(store).__mro__):
        from ..stores.redis.results import RedisResults

        return RedisResults(store)
    raise LockStoreMisconfigured(
        f"lock store {store.alias!r} ({type(store).__name__}) keeps no idempotent results: "
        f"give the class a method result_store(self) returning a "
        f"django_keel_lock.stores.results.ResultStore, or use a database, Redis or memory store"
    )


def take_kept(handle: Lock, results: ResultStore) -> StoredResult | None:
    """The result kept under the key `handle` holds, or None (the lock still held); when there
    is one, the store operation that read it released the lock too, and the handle ends as a
    release leaves it (`ResultStore.get_releasing`, `Lock.release_with`)."""
    found: list[StoredResult | None] = [None]

    def get(key: str, owner: str) -> bool | None:
        found[0], released = results.get_releasing(key, owner, handle.store.release)
        return released

    handle.release_with(get)
    return found[0]


def keep_releasing(handle: Lock, results: ResultStore, result: StoredResult, ttl: float) -> bool:
    """Keep `result` for `ttl` seconds, fenced by the acquisition `handle` holds, and release
    it by the same store operation (`ResultStore.save_releasing`); whether it was kept."""
    fence, kept = handle.fence, [False]
    if fence is None:
        return False

    def save(key: str, owner: str) -> bool:
        kept[0], released = results.save_releasing(
            key, owner, fence, result, ttl, handle.store.release
        )
        return released

    handle.release_with(save)
    return kept[0]


def after_commit(step: Callable[[], None]) -> bool:
    """Run `step` now, or, inside transactions (ATOMIC_REQUESTS), once all of them have
    committed: what is kept then matches what was written. False, and `step` not run, when one
    is already marked for rollback."""
    open_ = [c for c in connections.all(initialized_only=True) if c.in_atomic_block]
    if not open_:
        step()
        return True
    if any(c.needs_rollback for c in open_):
        return False
    pending = {c.alias for c in open_}

    def committed(alias: str) -> None:
        pending.discard(alias)
        if not pending:
            step()

    for connection in open_:
        transaction.on_commit(partial(committed, connection.alias), using=connection.alias)
    return True
