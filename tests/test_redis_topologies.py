"""RedisLockStore on a real Redis Cluster and behind a real Sentinel, both started here."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_keel_lock import LockStoreUnavailable, get_lock_store, lock
from django_keel_lock.stores import RedisLockStore
from django_keel_lock.stores.base import SHARED, semaphore_mode

from .conftest import TimeLimit, interrupted_after, needs, serving
from .support.redis_servers import (
    REDIS_SERVER,
    FaultyProxy,
    RedisServer,
    SentinelSetup,
    check_lost_release_reply,
    master_of,
    redis_cluster,
    redis_sentinel,
    via_sentinel,
    wait_for,
)

pytestmark = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    with redis_cluster(3) as nodes:
        yield nodes


@pytest.fixture
def cluster_alias(cluster: list[RedisServer]) -> Iterator[str]:
    store = RedisLockStore(
        f"cluster-{uuid.uuid4().hex[:8]}", {"URL": cluster[0].url, "CLUSTER": True}
    )
    with serving(store) as alias:
        yield alias


def _wait_push(store: RedisLockStore, key: str) -> None:
    with store.watch(key):
        deadline = time.monotonic() + 10
        while not store.push_wakeups and time.monotonic() < deadline:
            time.sleep(0.02)
    assert store.push_wakeups, "the listener never subscribed"


def _wake_after(alias: str, key: str, release: Callable[[], bool]) -> float:
    """Seconds from `release()` to a thread waiting on `key` (through `alias`) getting it.

    The waiter polls only every 10 s, so a quick wake-up can only come from pub/sub."""
    woke: list[float] = []

    def wait() -> None:
        handle = lock(key, ttl=30, store=alias)
        if handle.acquire(timeout=15, retry_delay=10):
            woke.append(time.monotonic())
            handle.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # the waiter is waiting
    released_at = time.monotonic()
    assert release()
    thread.join(20)
    assert woke, "the waiter never got the lock"
    return woke[0] - released_at


def test_cluster_locks_keys_on_every_node_with_shared_hash_tags(
    cluster: list[RedisServer], cluster_alias: str, key: str
) -> None:
    client: redis.RedisCluster[bytes] = redis.RedisCluster.from_url(cluster[0].url)
    try:
        keys = [f"{key}:{i:02d}" for i in range(24)]
        handles = [lock(name, ttl=30, store=cluster_alias) for name in keys]
        assert all(handle.acquire() for handle in handles)
        store = get_lock_store(cluster_alias)
        assert isinstance(store, RedisLockStore)
        nodes = set()
        for name in keys:
            lock_name, fence_name = store._names(name)
            slot = client.keyslot(lock_name)
            assert slot == client.keyslot(fence_name)
            node = client.nodes_manager.get_node_from_slot(slot)  # type: ignore[arg-type]
            nodes.add(node.port)
        assert len(nodes) == 3, "the keys should have spread over all three masters"
        assert not lock(keys[0], store=cluster_alias).acquire()
        listed = list(store.iter_locks(prefix=f"{key}:"))  # SCAN on every master
        assert [info.key for info in listed] == keys
        assert [info.fence for info in listed] == [handle.fence for handle in handles]
        assert all(handle.release() for handle in handles)
        again = lock(keys[0], store=cluster_alias)
        assert again.acquire() and (again.fence or 0) > (handles[0].fence or 0)
        assert again.release()
    finally:
        client.close()


def test_cluster_release_whose_reply_is_lost_is_an_error_not_a_retried_false(key: str) -> None:
    """redis-py's cluster client retries a command whose connection dropped; a retried release
    finds its own release done and would report the lock lost. The store's cluster client does
    not retry: the caller hears LockStoreUnavailable, and Redis released the lock once."""
    with redis_cluster(3) as nodes:
        # Clients reach node 1 only through a proxy: it announces the proxy's port.
        proxy = FaultyProxy(nodes[1].port)
        nodes[1].cli("config", "set", "cluster-announce-bus-port", str(nodes[1].port + 10000))
        nodes[1].cli("config", "set", "cluster-announce-port", str(proxy.port))
        deadline = time.monotonic() + 20
        while str(proxy.port) not in nodes[0].cli("cluster", "nodes"):
            assert time.monotonic() < deadline, "node 1 never announced the proxy"
            time.sleep(0.1)
        store = RedisLockStore("cluster-lost", {"URL": nodes[0].url, "CLUSTER": True})
        client: redis.RedisCluster[bytes] = redis.RedisCluster.from_url(nodes[0].url)
        try:
            name = next(
                f"{key}:{index}"
                for index in range(500)
                if client.nodes_manager.get_node_from_slot(  # type: ignore[arg-type]
                    client.keyslot(store._names(f"{key}:{index}")[0])
                ).port
                == proxy.port
            )
            with serving(store):
                check_lost_release_reply(proxy, store, name)
        finally:
            client.close()
            proxy.close()


def test_cluster_release_on_one_node_wakes_a_waiter_subscribed_elsewhere(
    cluster: list[RedisServer], cluster_alias: str, key: str
) -> None:
    # The waiter's store subscribes through another node than the one holding the key.
    waiter_store = RedisLockStore(
        f"cluster-waiter-{uuid.uuid4().hex[:8]}", {"URL": cluster[2].url, "CLUSTER": True}
    )
    with serving(waiter_store) as alias:
        holder = lock(key, ttl=30, store=cluster_alias)
        assert holder.acquire()
        _wait_push(waiter_store, key)
        assert _wake_after(alias, key, holder.release) < 0.5


async def test_cluster_async_methods(cluster_alias: str, key: str) -> None:
    store = get_lock_store(cluster_alias)
    got = await store.aacquire(key, "a" * 32, "h", 5)
    assert got.fence is not None
    assert (await store.aacquire(key, "b" * 32, "h", 5)).fence is None
    assert await store.aextend(key, "a" * 32, 20)
    info = await store.aget(key)
    assert info is not None and info.expires_in > 15 and info.fence == got.fence
    assert await store.arelease(key, "a" * 32)
    assert await store.aget(key) is None


def test_cluster_semaphore_keeps_its_permit_keys_on_the_key_s_node(
    cluster: list[RedisServer], cluster_alias: str, key: str
) -> None:
    store = get_lock_store(cluster_alias)
    assert isinstance(store, RedisLockStore)
    two = semaphore_mode(2)
    client: redis.RedisCluster[bytes] = redis.RedisCluster.from_url(cluster[0].url)
    try:
        keys = [f"{key}:{i:02d}" for i in range(12)]
        nodes = {
            client.nodes_manager.get_node_from_slot(  # type: ignore[arg-type]
                client.keyslot(store._names(name)[0])
            ).port
            for name in keys
        }
        assert len(nodes) == 3, "the keys should have spread over all three masters"
        for name in keys:
            a, b, c = (uuid.uuid4().hex for _ in range(3))
            fa, fb = (store.acquire_permit(name, o, o, 30, two).fence for o in (a, b))
            assert fa is not None and fb is not None and fb > fa
            refused = store.acquire_permit(name, c, "c", 30, two)
            assert refused.fence is None and refused.held_as == "semaphore"
            assert store.acquire(name, c, "c", 30).held_as == "semaphore"
            assert store.release_permit(name, a)
            assert (store.acquire_permit(name, c, "c", 30, two).fence or 0) > fb
            holders = store.holders(name)
            assert sorted(i.owner for i in holders) == sorted([b, c])
            assert {i.mode for i in holders} == {"semaphore"}
        listed = list(store.iter_locks(prefix=f"{key}:"))  # SCAN on every master
        assert len(listed) == 2 * len(keys) and not any(i.is_gate for i in listed)
        for info in listed:
            assert store.release_permit(info.key, info.owner)
        assert all(store.holders(name) == [] for name in keys)
    finally:
        client.close()


async def test_cluster_async_permit_methods(cluster_alias: str, key: str) -> None:
    store = get_lock_store(cluster_alias)
    got = await store.aacquire_permit(key, "a" * 32, "a", 5, SHARED)
    assert got.fence is not None
    assert await store.aextend_permit(key, "a" * 32, 20)
    [info] = await store.aholders(key)
    assert info.expires_in > 15 and info.fence == got.fence and info.mode == "shared"
    assert await store.arelease_permit(key, "a" * 32)
    assert await store.aholders(key) == []


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelSetup]:
    with redis_sentinel("keelmaster") as setup:
        yield setup


@pytest.fixture
def sentinel_alias(sentinel: SentinelSetup) -> Iterator[str]:
    with via_sentinel(sentinel.sentinel.port) as alias:
        yield alias


@contextmanager
def sentinel_behind_proxy(service: str, **pool_kwargs: Any) -> Iterator[tuple[str, FaultyProxy]]:
    """A store through Sentinel whose master is reached through a FaultyProxy: (alias, proxy)."""
    proxy = FaultyProxy(0)
    try:
        with redis_sentinel(service, monitor_port=proxy.port) as setup:
            proxy.target_port = setup.master.port
            with via_sentinel(setup.sentinel.port, service, **pool_kwargs) as alias:
                yield alias, proxy
    finally:
        proxy.close()


def test_sentinel_release_whose_reply_is_lost_is_an_error_not_a_retried_false(key: str) -> None:
    """The same for the client django-redis builds for Sentinel, given retries by the project:
    the sentinel hands out a proxy in front of the master."""
    with sentinel_behind_proxy("keellost", retry=Retry(NoBackoff(), 3)) as (alias, proxy):
        check_lost_release_reply(proxy, get_lock_store(alias), key)


def test_sentinel_call_interrupted_mid_reply_leaves_no_reply_for_the_next_call(key: str) -> None:
    """A task's time limit (here a signal) interrupts a release waiting for its reply. Had the
    connection stayed, the next call would read that reply ("1") as its own: a lock "acquired"
    with fence 1."""
    with sentinel_behind_proxy("keelstop") as (alias, proxy):
        store = get_lock_store(alias)
        held = lock(key, ttl=30, store=alias)
        assert held.acquire()
        proxy.mode = "stall"
        with pytest.raises(TimeLimit), interrupted_after(0.3):
            held.release()
        # The next call on this thread's connection goes out while the proxy still holds the
        # release; then both pass.
        threading.Timer(0.3, lambda: setattr(proxy, "mode", "pass")).start()
        fence = store.acquire(f"{key}:other", "b" * 32, "h", 30).fence
        info = store.get(f"{key}:other")
        assert info is not None and info.owner == "b" * 32 and info.fence == fence


def test_sentinel_client_is_reused_and_locks_land_on_the_master(
    sentinel: SentinelSetup, sentinel_alias: str, key: str
) -> None:
    master = sentinel.master
    handle = lock(key, ttl=30, store=sentinel_alias, holder="via-sentinel")
    assert handle.acquire()
    assert "via-sentinel" in master.cli("hget", f"keel-lock:{{{key}}}", "h")
    assert not lock(key, store=sentinel_alias).acquire()
    store = get_lock_store(sentinel_alias)
    assert isinstance(store, RedisLockStore)
    _wait_push(store, key)
    # Released by a plain client on the master, as another server would: only pub/sub tells us.
    plain = RedisLockStore("plain", {"URL": master.url})
    try:
        assert (
            _wake_after(sentinel_alias, key, lambda: plain.release(key, handle.owner or "")) < 0.5
        )
    finally:
        plain.close()


async def test_sentinel_async_methods_use_an_async_sentinel_client(
    sentinel_alias: str, key: str
) -> None:
    store = get_lock_store(sentinel_alias)
    assert isinstance(store, RedisLockStore) and store._native_async()
    got = await store.aacquire(key, "a" * 32, "h", 5)
    assert got.fence is not None
    assert (await store.aacquire(key, "b" * 32, "h", 5)).fence is None
    info = await store.aget(key)
    assert info is not None and info.owner == "a" * 32
    assert await store.arelease(key, "a" * 32)


async def test_sentinel_multi_key_locks_are_one_script_on_the_master(
    sentinel: SentinelSetup, sentinel_alias: str, key: str
) -> None:
    store = get_lock_store(sentinel_alias)
    assert isinstance(store, RedisLockStore) and store.atomic_many
    keys, owner = (f"{key}:1", f"{key}:2"), "a" * 32
    assert store.acquire_many(keys, owner, "h", 30).fences is not None
    for each in keys:
        assert owner in sentinel.master.cli("hget", store.lock_name(each), "o")
    assert (await store.aacquire_many(keys, "b" * 32, "h", 30)).blocked == keys
    assert await store.aextend_many(keys, owner, 30)
    assert store.release_many(keys, owner)
    assert (await store.aacquire_many(keys, "b" * 32, "h", 30)).fences is not None
    assert await store.arelease_many(keys, "b" * 32)


def test_sentinel_reconnect_behind_a_frozen_sentinel_gives_up_within_socket_timeout(
    key: str,
) -> None:
    """A thread's connection that must find the master again asks the sentinels within the
    store's SOCKET_TIMEOUT too, not on the sentinel clients' own sockets (5 s in redis-py 8,
    no limit before)."""
    with (
        redis_sentinel("keelfrozen") as setup,
        via_sentinel(setup.sentinel.port, "keelfrozen", {"SOCKET_TIMEOUT": 0.5}) as alias,
    ):
        store = get_lock_store(alias)
        assert store.acquire(key, "a" * 32, "h", 30).acquired
        assert setup.sentinel.process is not None
        setup.sentinel.process.send_signal(signal.SIGSTOP)
        try:
            setup.master.cli("client", "kill", "type", "normal")  # our connection goes
            started = time.monotonic()
            with pytest.raises(LockStoreUnavailable):
                store.release(key, "a" * 32)
            assert time.monotonic() - started < 2.0
        finally:
            setup.sentinel.process.send_signal(signal.SIGCONT)
        assert store.release(key, "a" * 32)  # it finds the master again


def test_sentinel_failover_is_an_outage_then_the_lock_lives_on_the_new_master(key: str) -> None:
    with redis_sentinel("keelfail", down_after_ms=1000, replicas=1) as setup:
        replica = setup.replicas[0]
        with via_sentinel(setup.sentinel.port, "keelfail") as alias:
            held = lock(key, ttl=60, store=alias)
            assert held.acquire()
            assert setup.master.cli("wait", "1", "5000").strip() == "1"  # replicated
            setup.master.kill()
            # No master: an error, never "someone else holds it".
            with pytest.raises(LockStoreUnavailable):
                lock(key, store=alias).acquire()
            wait_for(lambda: master_of(setup.sentinel, "keelfail") == replica.port, what="failover")
            other = lock(key, store=alias)

            def answered() -> bool:
                try:
                    assert other.acquire() is False  # the replicated lock is still held
                except LockStoreUnavailable:
                    return False  # the promoted replica may still refuse writes a moment
                return True

            wait_for(answered, seconds=10, what="the new master to answer")
            assert held.release()
            assert other.acquire() and (other.fence or 0) > (held.fence or 0)
            assert (other.owner or "?") in replica.cli("hget", f"keel-lock:{{{key}}}", "o")
            assert other.release()
