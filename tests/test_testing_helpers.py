"""django_keel_lock.testing and the store registry: what users reach for in their own tests."""

from __future__ import annotations

import pytest

from django_keel_lock import get_lock_store, lock, set_lock_store
from django_keel_lock.stores import DatabaseLockStore, MemoryLockStore
from django_keel_lock.testing import memory_lock_store


def test_memory_lock_store_swaps_default_and_restores_it() -> None:
    before = get_lock_store()
    assert isinstance(before, DatabaseLockStore)
    with memory_lock_store() as store:
        assert get_lock_store() is store and isinstance(store, MemoryLockStore)
        held = lock("helper:k")
        assert held.acquire()
        assert store.get("helper:k") is not None
        with memory_lock_store() as inner:  # nested: a fresh store, then the outer one again
            assert lock("helper:k").acquire()
            assert get_lock_store() is inner
        assert get_lock_store() is store
        assert not lock("helper:k").acquire()
    assert get_lock_store() is before


def test_memory_lock_store_as_decorator_for_several_aliases() -> None:
    seen: list[object] = []

    @memory_lock_store("default", "postgres")
    def body() -> None:
        seen.extend([get_lock_store(), get_lock_store("postgres")])

    body()
    first, second = seen
    assert isinstance(first, MemoryLockStore) and isinstance(second, MemoryLockStore)
    assert first is not second
    assert get_lock_store("postgres") is not second


def test_fixture_gives_a_fresh_store_per_test(keel_lock_memory_store: MemoryLockStore) -> None:
    assert get_lock_store() is keel_lock_memory_store
    assert list(keel_lock_memory_store.iter_locks()) == []
    assert lock("fixture:k").acquire()


def test_fixture_store_is_not_shared_between_tests(
    keel_lock_memory_store: MemoryLockStore,
) -> None:
    assert lock("fixture:k").acquire()  # the previous test's lock is gone


def test_advance_clock_expires_locks_without_sleeping() -> None:
    with memory_lock_store() as store:
        stale = lock("clock:k", ttl=60)
        assert stale.acquire()
        store.advance_clock(61)
        fresh = lock("clock:k")
        assert fresh.acquire()
        assert stale.release() is False
        assert fresh.fence is not None and stale.fence is not None and fresh.fence > stale.fence


def test_set_lock_store_overrides_settings_until_cleared() -> None:
    store = MemoryLockStore("mine")
    set_lock_store(store, "custom")
    try:
        assert get_lock_store("custom") is store
        assert lock("custom:k", store="custom").store is store
    finally:
        set_lock_store(None, "custom")
    with pytest.raises(Exception, match="'custom' is not in KEEL_LOCK_STORES"):
        get_lock_store("custom")
    with pytest.raises(TypeError, match="store must be a LockStore"):
        set_lock_store(object(), "custom")  # type: ignore[arg-type]


@memory_lock_store()
async def test_memory_lock_store_decorates_async_tests_for_their_whole_body() -> None:
    import asyncio

    await asyncio.sleep(0)
    store = get_lock_store()
    assert isinstance(store, MemoryLockStore)
    assert await lock("async-helper:k").aacquire()
