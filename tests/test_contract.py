"""The contract every store passes unchanged: memory, SQLite, PostgreSQL, MariaDB, Redis, etcd.

Written against the public Lock API, so the core and the store are tested together. A third
party's store joins as the alias "third-party" when KEEL_LOCK_CONTRACT_STORE names it
(tests/conftest.py, docs/writing-a-store.md). Where a test waits for a lock to expire, it waits
the store's `expiry_slack` more (etcd's leases count whole seconds; 0 for the others).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from django_keel_lock import (
    Lock,
    LockError,
    LockNotHeldError,
    LockUnavailable,
    restore_lock,
)
from django_keel_lock.stores import LockStore
from tests.conftest import CONTRACT_STORES


@pytest.fixture(params=CONTRACT_STORES)
def store_alias(request: pytest.FixtureRequest) -> str:
    """Every store of the contract: the built-in ones and, if named, the third party's."""
    if request.param == "etcd":
        request.getfixturevalue("etcd_alias")
    return str(request.param)


def test_acquire_then_second_handle_is_refused(make_lock: Callable[..., Lock]) -> None:
    first, second = make_lock(), make_lock()
    assert first.acquire()
    assert first.held and first.owner and first.fence is not None
    assert not second.acquire()
    assert second.owner is None and second.fence is None
    assert first.release()
    assert second.acquire()
    assert second.release()


def test_owner_is_random_per_acquisition(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock()
    owners = set()
    for _ in range(3):
        assert handle.acquire()
        owners.add(handle.owner)
        assert handle.release()
    assert len(owners) == 3
    assert all(len(owner or "") == 32 for owner in owners)


def test_fence_strictly_increases_across_release_expiry_and_takeover(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    fences = []
    a = make_lock(ttl=0.3)
    assert a.acquire()
    fences.append(a.fence)
    assert a.release()
    assert a.acquire()
    fences.append(a.fence)
    time.sleep(0.45 + store.expiry_slack)  # a expires without releasing
    b = make_lock(ttl=5)
    assert b.acquire()
    fences.append(b.fence)
    store.prune()  # cleanup must not reset fences either
    assert b.release()
    store.prune()
    c = make_lock()
    assert c.acquire()
    fences.append(c.fence)
    assert c.release()
    assert fences == sorted(fences) and len(set(fences)) == len(fences), fences


def test_expired_lock_is_taken_over_and_stale_release_returns_false_keeping_new_holder(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    stale = make_lock(ttl=0.2)
    assert stale.acquire()
    time.sleep(0.35 + store.expiry_slack)
    assert stale.is_expired()
    fresh = make_lock(ttl=10)
    assert fresh.acquire()
    assert fresh.fence is not None and stale.fence is not None and fresh.fence > stale.fence
    assert stale.release() is False
    assert not stale.held
    info = fresh.info()
    assert info is not None and info.owner == fresh.owner
    assert fresh.is_locked() and not fresh.is_expired()
    assert fresh.release()


def test_release_after_takeover_returns_false_and_keeps_new_holder(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    # The first handle still believes it holds (its ttl is far off): only the store can tell
    # that the key changed hands, by comparing owners.
    first = make_lock(ttl=30)
    assert first.acquire()
    assert store.force_release(first.key) is not None
    second = make_lock(ttl=30)
    assert second.acquire()
    assert first.release() is False
    info = second.info()
    assert info is not None and info.owner == second.owner
    assert second.is_owned()
    assert second.release()


def test_the_same_owner_asking_again_gets_its_acquisition_back(store: LockStore, key: str) -> None:
    # What a retry after a lost reply does: the lock is the asker's already.
    first = store.acquire(key, "owner-a", "h", 30)
    again = store.acquire(key, "owner-a", "h", 30)
    assert first.fence is not None and again.fence is not None
    assert again.fence >= first.fence
    assert store.acquire(key, "owner-b", "h", 30).fence is None
    info = store.get(key)
    assert info is not None and info.owner == "owner-a"
    assert store.release(key, "owner-a")


def test_stale_extend_raises_and_marks_handle_not_held(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    stale = make_lock(ttl=0.2)
    assert stale.acquire()
    time.sleep(0.35 + store.expiry_slack)
    fresh = make_lock(ttl=10)
    assert fresh.acquire()
    with pytest.raises(LockNotHeldError, match="expired or was taken over"):
        stale.extend()
    assert not stale.held
    assert fresh.info() is not None and fresh.info().owner == fresh.owner  # type: ignore[union-attr]
    fresh.release()


def test_extend_pushes_expiry_out(make_lock: Callable[..., Lock], store: LockStore) -> None:
    handle = make_lock(ttl=0.5)
    assert handle.acquire()
    handle.extend(5)
    remaining = handle.remaining_time()
    slack = store.expiry_slack  # etcd's remaining time is whole seconds, rounded down
    assert remaining is not None and 4.0 - slack < remaining <= 5.01  # SQLite keeps ms
    time.sleep(0.6)
    assert not handle.is_expired()
    assert not make_lock().acquire()
    handle.extend(0.1)  # extend never shortens
    remaining = handle.remaining_time()
    assert remaining is not None and remaining > 3.0
    assert handle.release()


def test_extend_without_holding_raises(make_lock: Callable[..., Lock]) -> None:
    with pytest.raises(LockNotHeldError, match="does not hold"):
        make_lock().extend()


def test_release_without_acquire_returns_false(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock()
    assert handle.release() is False
    assert handle.acquire()
    assert handle.release() is True
    assert handle.release() is False


def test_acquire_twice_on_one_handle_is_an_error(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock()
    assert handle.acquire()
    with pytest.raises(LockError, match="already holds"):
        handle.acquire()
    handle.release()


def test_inspection_reports_holder_fence_and_remaining(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    handle = make_lock(ttl=30, holder="worker-3")
    assert not handle.is_locked()
    assert handle.remaining_time() is None
    assert handle.info() is None
    assert handle.acquire()
    info = handle.info()
    assert info is not None
    assert info.key == handle.key and info.holder == "worker-3" and info.fence == handle.fence
    assert info.owner == handle.owner
    assert 29.0 - store.expiry_slack < info.expires_in <= 30.01
    assert info.acquired_at is not None and info.acquired_at.tzinfo is not None
    other = make_lock()
    assert other.is_locked()
    rt = other.remaining_time()
    assert rt is not None and 29.0 - store.expiry_slack < rt <= 30.01
    assert handle.release()
    assert not other.is_locked()


def test_run_calls_fn_only_when_acquired_and_always_releases(
    make_lock: Callable[..., Lock],
) -> None:
    handle = make_lock()
    outcome = handle.run(lambda: handle.is_locked())
    assert outcome == (True, True)
    ran, result = outcome
    assert ran and result is True and outcome.acquired and outcome.value is True
    assert not handle.is_locked()

    blocker = make_lock()
    assert blocker.acquire()
    calls: list[int] = []
    assert make_lock().run(lambda: calls.append(1)) == (False, None)
    assert make_lock().run_immediately(lambda: calls.append(1)) == (False, None)
    assert calls == []
    blocker.release()

    def boom() -> None:
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        make_lock().run(boom)
    assert not blocker.is_locked()


def test_run_waits_for_release_within_timeout(make_lock: Callable[..., Lock]) -> None:
    holder = make_lock()
    assert holder.acquire()
    timer = threading.Timer(0.2, holder.release)
    timer.start()
    started = time.monotonic()
    outcome = make_lock().run(lambda: "done", timeout=5, retry_delay=0.02)
    waited = time.monotonic() - started
    timer.join()
    assert outcome == (True, "done")
    assert 0.15 < waited < 2.0


def test_wait_gives_up_at_deadline_without_big_overshoot(make_lock: Callable[..., Lock]) -> None:
    holder = make_lock(ttl=30)
    assert holder.acquire()
    started = time.monotonic()
    assert not make_lock().acquire(timeout=0.3, retry_delay=0.05)
    waited = time.monotonic() - started
    assert 0.3 <= waited < 0.3 + 0.5  # one retry plus a round trip at most
    holder.release()


def test_waiter_takes_over_when_holder_expires(
    make_lock: Callable[..., Lock], store: LockStore
) -> None:
    holder = make_lock(ttl=0.3)
    assert holder.acquire()
    started = time.monotonic()
    waiter = make_lock()
    assert waiter.acquire(timeout=3)
    assert time.monotonic() - started < 1.5 + store.expiry_slack
    assert waiter.fence is not None and holder.fence is not None and waiter.fence > holder.fence
    waiter.release()


def test_context_manager_raises_when_held_and_releases_on_exit(
    make_lock: Callable[..., Lock],
) -> None:
    with make_lock(timeout=0.1) as handle:
        assert handle.held and handle.is_locked()
        with pytest.raises(LockUnavailable) as caught:
            with make_lock(timeout=0.1):
                pytest.fail("the body ran without the lock")
        assert caught.value.key == handle.key
    assert not handle.is_locked()
    with pytest.raises(ValueError, match="body"):
        with make_lock() as again:
            raise ValueError("body")
    assert not again.is_locked()


def test_serialize_restore_releases_from_another_handle(make_lock: Callable[..., Lock]) -> None:
    original = make_lock(ttl=20, holder="web-1:42")
    assert original.acquire()
    token = original.serialize()
    restored = restore_lock(token)
    assert (restored.key, restored.owner, restored.fence, restored.holder, restored.ttl) == (
        original.key,
        original.owner,
        original.fence,
        "web-1:42",
        20.0,
    )
    assert restored.store_alias == original.store_alias
    restored.extend(40)
    rt = original.remaining_time()
    assert rt is not None and rt > 30
    assert restored.release()
    assert original.release() is False


def test_force_release_frees_any_holder(make_lock: Callable[..., Lock], store: LockStore) -> None:
    handle = make_lock(holder="someone")
    assert handle.acquire()
    info = store.force_release(handle.key)
    assert info is not None and info.owner == handle.owner and info.holder == "someone"
    assert store.force_release(handle.key) is None
    assert not handle.is_locked()
    assert handle.release() is False


def test_iter_locks_streams_live_locks_under_prefix(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handles = [make_lock(f"{key}:{i:03d}") for i in range(7)]
    for handle in handles:
        assert handle.acquire()
    handles[3].release()
    expired = make_lock(f"{key}:900", ttl=0.1)
    assert expired.acquire()
    time.sleep(0.2 + store.expiry_slack)
    other = make_lock(f"other-{key}")
    assert other.acquire()
    listed = list(store.iter_locks(prefix=key + ":"))
    assert [info.key for info in listed] == [h.key for i, h in enumerate(handles) if i != 3]
    assert {info.fence for info in listed} == {h.fence for i, h in enumerate(handles) if i != 3}
    for handle in [*handles, other]:
        handle.release()


def test_prune_removes_expired_entries_only(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    live = make_lock(f"{key}:live", ttl=30)
    dead = make_lock(f"{key}:dead", ttl=0.1)
    assert live.acquire() and dead.acquire()
    time.sleep(0.2 + store.expiry_slack)
    assert store.prune() >= 0
    assert live.is_locked()
    assert [info.key for info in store.iter_locks(prefix=key)] == [live.key]
    live.release()


def test_unicode_and_long_keys_are_distinct(make_lock: Callable[..., Lock], key: str) -> None:
    names = [f"{key}:Ä", f"{key}:ä", f"{key}:a", f"{key}:a ", f"{key}:🔒", f"{key}:A"]
    handles = [make_lock(name) for name in names]
    for handle in handles:
        assert handle.acquire(), handle.key
    for handle in handles:
        info = handle.info()
        assert info is not None and info.key == handle.key and info.owner == handle.owner
        assert handle.release()
