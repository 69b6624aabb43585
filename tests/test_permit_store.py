"""The permit operations of the LockStore protocol, store by store (semaphores, shared locks).

Below the Lock handle on purpose: every store with `supports_modes` answers these the same way
(what `stores.permits.plan_acquire` decides), so the handle can rely on them.
"""

from __future__ import annotations

import secrets
import time

import pytest

from django_keel_lock import get_lock_store
from django_keel_lock.stores import LockStore
from django_keel_lock.stores.base import EXCLUSIVE, SHARED, semaphore_mode
from tests.conftest import store_params

MODAL_STORES = store_params(["memory", "sqlite", "postgres", "mariadb", "redis"])
THREE = semaphore_mode(3)


@pytest.fixture(params=MODAL_STORES)
def store(request: pytest.FixtureRequest) -> LockStore:
    return get_lock_store(str(request.param))


def owner() -> str:
    return secrets.token_hex(16)


def test_semaphore_gives_limit_permits_with_increasing_fences_then_refuses(
    store: LockStore, key: str
) -> None:
    owners = [owner() for _ in range(4)]
    fences = [store.acquire_permit(key, o, f"h{i}", 5, THREE).fence for i, o in enumerate(owners)]
    assert None not in fences[:3] and fences[:3] == sorted(fences[:3])  # type: ignore[type-var]
    assert len(set(fences[:3])) == 3
    refused = store.acquire_permit(key, owners[3], "h3", 5, THREE)
    assert refused.fence is None and refused.held_as == "semaphore"
    assert refused.retry_in is not None and 4 < refused.retry_in <= 5.01  # SQLite: julian days
    assert store.release_permit(key, owners[1])
    granted = store.acquire_permit(key, owners[3], "h3", 5, THREE)
    assert granted.fence is not None and granted.fence > max(fences[:3])  # type: ignore[type-var]
    assert {i.owner for i in store.holders(key)} == {owners[0], owners[2], owners[3]}


def test_same_owner_asking_again_gets_its_permit_back(store: LockStore, key: str) -> None:
    me = owner()
    first = store.acquire_permit(key, me, "me", 0.5, THREE)
    again = store.acquire_permit(key, me, "me", 5, THREE)
    assert first.fence is not None and again.fence == first.fence
    time.sleep(0.7)  # the renewed ttl counts, not the first one
    assert [i.owner for i in store.holders(key)] == [me]


def test_exclusive_acquire_is_refused_while_permits_live_and_fences_go_on_after(
    store: LockStore, key: str
) -> None:
    a, b = owner(), owner()
    fa = store.acquire_permit(key, a, "a", 5, THREE).fence
    fb = store.acquire_permit(key, b, "b", 5, THREE).fence
    refused = store.acquire(key, owner(), "x", 5)
    assert refused.fence is None and refused.held_as == "semaphore"
    assert store.release_permit(key, a) and store.release_permit(key, b)
    assert store.holders(key) == [] and store.get(key) is None
    writer = owner()
    taken = store.acquire(key, writer, "w", 5)
    assert taken.fence is not None and fa is not None and fb is not None
    assert taken.fence > max(fa, fb)
    assert store.release(key, writer)


def test_permit_is_refused_while_an_exclusive_lock_is_held(store: LockStore, key: str) -> None:
    writer = owner()
    assert store.acquire(key, writer, "w", 2).fence is not None
    for mode in (SHARED, THREE):
        refused = store.acquire_permit(key, owner(), "r", 5, mode)
        assert refused.fence is None and refused.held_as == "exclusive"
        assert refused.retry_in is not None and 1 < refused.retry_in <= 2.01
    assert store.release(key, writer)
    assert store.acquire_permit(key, owner(), "r", 5, SHARED).fence is not None


def test_shared_and_semaphore_permits_refuse_each_other_saying_how_the_key_is_held(
    store: LockStore, key: str
) -> None:
    reader = owner()
    assert store.acquire_permit(key, reader, "r", 5, SHARED).fence is not None
    refused = store.acquire_permit(key, owner(), "s", 5, THREE)
    assert refused.fence is None and refused.held_as == "shared"
    assert store.acquire(key, owner(), "x", 5).held_as == "shared"
    assert store.release_permit(key, reader)
    assert store.acquire_permit(key, owner(), "s", 5, THREE).fence is not None


def test_waiting_writer_keeps_new_readers_out_until_it_has_the_lock(
    store: LockStore, key: str
) -> None:
    r1, r2, writer = owner(), owner(), owner()
    assert store.acquire_permit(key, r1, "r1", 5, SHARED).fence is not None
    assert store.acquire_permit(key, r2, "r2", 5, SHARED).fence is not None
    waiting = store.acquire_permit(key, writer, "w", 5, EXCLUSIVE, writer_wait=10)
    assert waiting.fence is None and waiting.held_as == "shared"
    late = store.acquire_permit(key, owner(), "r3", 5, SHARED)
    assert late.fence is None and late.held_as == "exclusive"  # a writer waits
    assert store.acquire_permit(key, r1, "r1", 5, SHARED).fence is not None  # its own, renewed
    assert store.release_permit(key, r1) and store.release_permit(key, r2)
    taken = store.acquire_permit(key, writer, "w", 5, EXCLUSIVE, writer_wait=10)
    assert taken.fence is not None
    assert store.get(key) is not None and store.get(key).owner == writer  # type: ignore[union-attr]
    assert store.release(key, writer)
    # The writer has had its turn: readers come in again at once.
    assert store.acquire_permit(key, owner(), "r4", 5, SHARED).fence is not None


def test_writer_that_stops_waiting_stops_blocking_readers(store: LockStore, key: str) -> None:
    reader = owner()
    assert store.acquire_permit(key, reader, "r", 5, SHARED).fence is not None
    gave_up = store.acquire_permit(key, owner(), "w", 5, EXCLUSIVE, writer_wait=0.3)
    assert gave_up.fence is None
    assert store.acquire_permit(key, owner(), "r2", 5, SHARED).fence is None
    time.sleep(0.45)
    assert store.acquire_permit(key, owner(), "r2", 5, SHARED).fence is not None


def test_expired_permit_frees_its_place_and_leaves_the_others(store: LockStore, key: str) -> None:
    two = semaphore_mode(2)
    short, long = owner(), owner()
    assert store.acquire_permit(key, short, "short", 0.3, two).fence is not None
    assert store.acquire_permit(key, long, "long", 5, two).fence is not None
    assert store.acquire_permit(key, owner(), "third", 5, two).fence is None
    time.sleep(0.45)
    assert not store.extend_permit(key, short, 5) and not store.release_permit(key, short)
    assert store.acquire_permit(key, owner(), "third", 5, two).fence is not None
    assert store.extend_permit(key, long, 5)
    assert sorted(i.holder for i in store.holders(key)) == ["long", "third"]


def test_extending_a_permit_keeps_the_key_held_past_its_first_ttl(
    store: LockStore, key: str
) -> None:
    me = owner()
    assert store.acquire_permit(key, me, "me", 0.4, THREE).fence is not None
    assert store.extend_permit(key, me, 5)
    time.sleep(0.6)
    assert store.acquire(key, owner(), "x", 5).fence is None
    assert [i.owner for i in store.holders(key)] == [me]
    assert store.release_permit(key, me)
    assert store.acquire(key, owner(), "x", 1).fence is not None


def test_holders_list_each_permit_with_its_mode_soonest_first_and_iter_locks_yields_them(
    store: LockStore, key: str
) -> None:
    owners = [owner() for _ in range(3)]
    for ttl, o in zip((30, 10, 20), owners, strict=True):
        assert store.acquire_permit(key, o, f"ttl{ttl}", ttl, THREE).fence is not None
    holders = store.holders(key)
    assert [i.holder for i in holders] == ["ttl10", "ttl20", "ttl30"]
    assert {i.mode for i in holders} == {"semaphore"}
    gate = store.get(key)
    assert gate is not None and gate.is_gate and gate.fence == max(i.fence for i in holders)
    listed = [i for i in store.iter_locks(prefix=key) if i.key == key]
    assert sorted(i.owner for i in listed) == sorted(owners)
    assert all(not i.is_gate for i in listed)


def test_force_release_by_fence_frees_one_permit_and_without_fence_all(
    store: LockStore, key: str
) -> None:
    owners = [owner() for _ in range(3)]
    fences = [store.acquire_permit(key, o, "h", 5, SHARED).fence for o in owners]
    freed = store.force_release(key, fences[1])
    assert freed is not None and freed.owner == owners[1] and freed.mode == "shared"
    assert sorted(i.fence for i in store.holders(key)) == sorted([fences[0], fences[2]])
    assert store.force_release(key, fences[1]) is None  # gone already
    while store.force_release(key) is not None:
        pass
    assert store.holders(key) == [] and store.acquire(key, owner(), "x", 1).fence is not None


def test_fences_strictly_increase_across_modes_and_prune(store: LockStore, key: str) -> None:
    fences = []
    for mode in (THREE, SHARED, EXCLUSIVE, THREE):
        me = owner()
        if mode is EXCLUSIVE:
            fences.append(store.acquire(key, me, "x", 5).fence)
            assert store.release(key, me)
        else:
            fences.append(store.acquire_permit(key, me, "p", 5, mode).fence)
            assert store.release_permit(key, me)
        store.prune()
    assert None not in fences and fences == sorted(fences)  # type: ignore[type-var]
    assert len(set(fences)) == len(fences)
