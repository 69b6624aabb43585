"""The etcd store when members fail: a 3-member cluster of the module's own, whose members the
tests kill, stop and restart (tests/support/etcd.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.stores import EtcdLockStore
from django_keel_lock.stores.base import AcquireResult
from django_keel_lock.stores.etcd.client import b64
from tests.conftest import skip_or_fail
from tests.support import ROOT
from tests.support.etcd import (
    Cluster,
    HoldsARequest,
    LosesOneReply,
    etcd_cluster,
    etcd_installed,
)
from tests.support.redis_servers import free_port


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if not etcd_installed():
        skip_or_fail("SERVER UNAVAILABLE: etcd (Debian's etcd-server) is not installed")
    with etcd_cluster() as made:
        yield made


@pytest.fixture
def healthy(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with every member running and a leader, before and after the test."""
    for member in cluster.members:
        if member.process is None:
            cluster.restart(member)
    cluster.wait_healthy()
    yield cluster
    for member in cluster.members:
        if member.process is not None and member.process.poll() is None:
            member.resume()
        else:
            cluster.restart(member)


def _store(endpoints: list[str], timeout: float = 5) -> EtcdLockStore:
    return EtcdLockStore("etcd-faults", {"ENDPOINTS": endpoints, "SOCKET_TIMEOUT": timeout})


def _unavailable_within(seconds: float, says: str, call: Callable[[], object]) -> None:
    """`call()` raises LockStoreUnavailable saying `says`, in less than `seconds`."""
    started = time.monotonic()
    with pytest.raises(LockStoreUnavailable, match=says):
        call()
    assert time.monotonic() - started < seconds


def test_killing_the_leader_keeps_the_lock_and_the_next_fence_is_greater(
    healthy: Cluster, key: str
) -> None:
    store = _store(healthy.endpoints)
    try:
        first = store.acquire(key, "owner-a", "a", 30)
        assert first.fence is not None
        leader = healthy.leader()
        leader.kill()
        healthy.leader()  # a new one is elected among the two left
        # The lock survived: nobody else gets it, and its owner can still release it.
        assert store.acquire(key, "owner-b", "b", 30).fence is None
        info = store.get(key)
        assert info is not None and info.owner == "owner-a" and info.fence == first.fence
        assert store.release(key, "owner-a")
        second = store.acquire(key, "owner-b", "b", 30)
        assert second.fence is not None and second.fence > first.fence
        assert store.release(key, "owner-b")
    finally:
        store.close()


def test_a_lock_whose_holder_died_is_taken_over_after_a_leader_kill_within_ttl_and_election(
    healthy: Cluster, key: str
) -> None:
    store = _store(healthy.endpoints)
    try:
        held = store.acquire(key, "owner-a", "a", 2)  # its holder never comes back
        assert held.fence is not None
        healthy.leader().kill()
        started = time.monotonic()
        while (taken := store.acquire(key, "owner-b", "b", 30)).fence is None:
            assert time.monotonic() - started < 2 + 1 + store.expiry_slack + 2
            time.sleep(0.1)
        # A new leader gives leases their whole TTL again: up to ttl + election, not sooner.
        assert taken.fence > held.fence
    finally:
        store.close()


def test_a_member_down_first_in_the_list_sends_calls_to_the_next(
    healthy: Cluster, key: str
) -> None:
    down = healthy.members[0]
    down.kill()
    healthy.leader()  # if it led, the others have elected another: only the endpoint is timed
    nothing = f"http://127.0.0.1:{free_port()}"  # nothing listens there either
    store = _store([nothing, down.url, *healthy.endpoints[1:]], timeout=3)
    try:
        started = time.monotonic()
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        assert time.monotonic() - started < 1.5  # refused connections fail over at once
        assert store.release(key, "owner-a")
    finally:
        store.close()


def test_a_stopped_member_first_in_the_list_is_passed_over_within_the_timeout(
    healthy: Cluster, key: str
) -> None:
    stopped = healthy.members[0]
    others = [m for m in healthy.members if m is not stopped]
    if healthy.leader() is stopped:  # keep the leader running: the others need one
        others[0].kill()
        healthy.restart(others[0])
        healthy.wait_healthy()
    stopped.pause()
    store = _store(healthy.endpoints, timeout=3)
    try:
        started = time.monotonic()
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        assert time.monotonic() - started < 3
    finally:
        stopped.resume()
        store.release(key, "owner-a")
        store.close()


def test_every_member_down_is_lock_store_unavailable_within_the_timeout(
    healthy: Cluster, key: str
) -> None:
    for member in healthy.members:
        member.pause()  # frozen: connections open, nothing answers
    store = _store(healthy.endpoints, timeout=1)
    try:
        for call in (
            lambda: store.acquire(key, "owner-a", "a", 30),
            lambda: store.release(key, "owner-a"),
            lambda: store.extend(key, "owner-a", 30),
            lambda: store.get(key),
        ):
            _unavailable_within(1.5, "cannot use etcd", call)
    finally:
        for member in healthy.members:
            member.resume()
        store.close()
    for member in healthy.members:
        member.kill()  # and gone: refused at once
    store = _store(healthy.endpoints, timeout=1)
    try:
        _unavailable_within(0.5, "Connection refused", lambda: store.acquire(key, "o", "a", 30))
    finally:
        store.close()


def test_a_member_cut_off_from_the_others_refuses_at_once_and_the_call_moves_on(
    healthy: Cluster, key: str
) -> None:
    """Two members stopped: the third has no leader and, asked with `hasleader`, says so at
    once instead of waiting for a quorum; with nowhere else to go that is an outage."""
    alone = next(m for m in healthy.members if m is not healthy.leader())
    for member in healthy.members:
        if member is not alone:
            member.pause()
    time.sleep(1.5)  # more than the election timeout: it knows it has no leader
    store = _store([alone.url], timeout=3)
    try:
        _unavailable_within(1, "no leader", lambda: store.acquire(key, "owner-a", "a", 30))
    finally:
        store.close()


def test_a_release_refused_by_a_member_without_a_leader_is_sent_to_the_next_member(
    healthy: Cluster, key: str
) -> None:
    """A member without a leader refuses before it applies anything (`hasleader`), so even a
    release, which is never sent twice once sent, moves on to the next member and frees the
    lock there. The leaderless member is one of a second cluster, two of whose members are
    stopped: this cluster keeps its quorum meanwhile."""
    holder = _store(healthy.endpoints)
    assert holder.acquire(key, "owner-a", "a", 30).acquired
    with etcd_cluster() as other:
        alone = next(m for m in other.members if m is not other.leader())
        for member in other.members:
            if member is not alone:
                member.pause()
        time.sleep(1.5)  # more than the election timeout: it knows it has no leader
        store = _store([alone.url, *healthy.endpoints], timeout=3)
        try:
            assert store.release(key, "owner-a")
        finally:
            store.close()
    try:
        assert holder.get(key) is None
    finally:
        holder.close()


def test_a_lock_survives_every_member_restarting(healthy: Cluster, key: str) -> None:
    store = _store(healthy.endpoints)
    try:
        held = store.acquire(key, "owner-a", "a", 30)
        assert held.fence is not None
        for member in healthy.members:
            member.kill()
        for member in healthy.members:
            member.start(healthy.initial, "existing")
        healthy.wait_healthy()
        info = store.get(key)  # on disk, with its lease: nobody else may take it
        assert info is not None and info.owner == "owner-a" and info.fence == held.fence
        assert store.acquire(key, "owner-b", "b", 30).fence is None
        assert store.release(key, "owner-a")
    finally:
        store.close()


def test_an_acquire_whose_reply_was_lost_is_sent_to_the_next_member_and_gets_its_lock(
    healthy: Cluster, key: str
) -> None:
    """The transaction is applied, its reply lost: the client sends it again to the next
    member, which finds the lock the asker's own; the lock is kept, with its fence and lease."""
    proxy = LosesOneReply(healthy.members[0].client_port)
    store = _store([proxy.url, *healthy.endpoints[1:]])
    try:
        proxy.armed = "/v3/kv/txn"
        taken = store.acquire(key, "owner-a", "a", 30)
        assert proxy.cut == 1 and taken.fence is not None
        time.sleep(0.5)  # a lease wrongly revoked behind the reply would be gone by now
        info = store.get(key)
        assert info is not None and info.owner == "owner-a" and info.fence == taken.fence
        assert store.acquire(key, "owner-b", "b", 30).fence is None
        assert store.release(key, "owner-a")
    finally:
        store.close()
        proxy.close()


def test_a_release_whose_reply_was_lost_is_unavailable_and_never_sent_twice(
    healthy: Cluster, key: str
) -> None:
    """Sent again, the release would find the lock gone and say "not released": instead the
    caller hears the store could not say (its handle keeps the owner)."""
    proxy = LosesOneReply(healthy.members[0].client_port)
    store = _store([proxy.url, *healthy.endpoints[1:]])
    try:
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        proxy.armed = "/v3/kv/txn"
        with pytest.raises(LockStoreUnavailable):
            store.release(key, "owner-a")
        assert proxy.cut == 1
        assert store.get(key) is None  # applied once, on the member behind the proxy
    finally:
        store.close()
        proxy.close()


def test_a_process_exits_promptly_with_lease_revocations_queued_against_a_frozen_cluster(
    healthy: Cluster,
) -> None:
    """Revocations run on the store's worker threads, which the interpreter waits for at exit:
    each waits at most 1 s and at most 16 are queued, the rest of the leases run out alone."""
    child = (
        "import django, sys; django.setup()\n"
        "from django_keel_lock.stores import EtcdLockStore\n"
        "store = EtcdLockStore('etcd-exit', {'ENDPOINTS': sys.argv[1].split(',')})\n"
        "for lease in range(1, 101): store.revoke_later(str(lease))\n"
    )
    for member in healthy.members:
        member.pause()
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", child, ",".join(healthy.endpoints)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "tests.settings"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - started
    finally:
        for member in healthy.members:
            member.resume()
    assert done.returncode == 0, done.stderr
    assert took < 15, f"exit took {took:.1f}s"  # 100 revocations of 5 s each: minutes


def test_an_acquire_unanswered_by_every_member_leaves_no_lock_behind(
    healthy: Cluster, key: str
) -> None:
    """The transaction is applied, its reply lost, and no other member to ask: the caller
    hears the store failed, so it will never release that lock; its lease is revoked behind
    the error, and the key is free well before the lock's ttl."""
    proxy = LosesOneReply(healthy.members[0].client_port)
    store = _store([proxy.url])
    other = _store(healthy.endpoints)
    try:
        proxy.armed = "/v3/kv/txn"
        with pytest.raises(LockStoreUnavailable):
            store.acquire(key, "owner-a", "a", 60)
        assert proxy.cut == 1
        deadline = time.monotonic() + 10
        while other.get(key) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.get(key) is None, "the lock the caller was told failed is still held"
        assert other.acquire(key, "owner-b", "b", 30).fence is not None
        assert other.release(key, "owner-b")
    finally:
        store.close()
        other.close()
        proxy.close()


def test_a_retry_whose_old_lease_is_revoked_between_its_transactions_takes_the_free_lock(
    healthy: Cluster, key: str
) -> None:
    """An acquire again by the same owner (a retry after an attempt that raised) finds the
    key its own, and the old attempt's lease is revoked (as that attempt's error revokes it)
    before the retry renews the key: the key is free then, and the retry takes it, rather
    than answer "held by someone else" for a free lock."""
    proxy = HoldsARequest(healthy.members[0].client_port)
    store = _store([proxy.url])
    other = _store(healthy.endpoints)
    try:
        assert store.acquire(key, "owner-a", "a", 60).fence is not None
        (found,) = other.call("/v3/kv/range", {"key": b64(store.lock_name(key))})["kvs"]
        proxy.hold = ("/v3/kv/txn", 1)  # the first transaction passes, the renewal waits
        result: list[object] = []
        thread = threading.Thread(
            target=lambda: result.append(store.acquire(key, "owner-a", "a", 60))
        )
        thread.start()
        try:
            assert proxy.holding.wait(10)
            other.call("/v3/lease/revoke", {"ID": found["lease"]})
            assert other.get(key) is None
        finally:
            proxy.go.set()
            thread.join(10)
        (taken,) = result
        assert isinstance(taken, AcquireResult) and taken.fence is not None, taken
        info = other.get(key)
        assert info is not None and info.owner == "owner-a"
        assert store.release(key, "owner-a")
    finally:
        store.close()
        other.close()
        proxy.close()
