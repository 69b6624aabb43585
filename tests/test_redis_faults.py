"""Outage is not contention: a Redis that dies, drops replies or stalls gives
LockStoreUnavailable, never "someone else holds it", and never two owners at once.

Every test here runs its own redis-server on a free port (and a proxy where it needs one).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_keel_lock import Lock, LockStoreUnavailable, lock
from django_keel_lock.stores import RedisLockStore

from .conftest import needs, serving
from .support.redis_servers import REDIS_SERVER, FaultyProxy, RedisServer, check_lost_release_reply
from .support.threads import waiting_in_thread

pytestmark = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def _store(url: str) -> RedisLockStore:
    return RedisLockStore(f"fault-{uuid.uuid4().hex[:8]}", {"URL": url})


@pytest.fixture
def direct(server: RedisServer) -> Iterator[tuple[str, RedisLockStore]]:
    store = _store(server.url + "?socket_timeout=1")
    with serving(store) as alias:
        yield alias, store


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def proxied(proxy: FaultyProxy) -> Iterator[tuple[str, RedisLockStore]]:
    store = _store(proxy.url + "?socket_timeout=1")
    with serving(store) as alias:
        # Warm up: the pooled connection is open and every script loaded, so the faults
        # below hit the lock scripts themselves, not the handshake or a NOSCRIPT reply.
        assert lock(f"warm-up:{uuid.uuid4().hex}", store=alias).run(lambda: None).acquired
        yield alias, store


def test_killed_server_while_held_raises_everywhere_and_keeps_the_owner(
    server: RedisServer, direct: tuple[str, RedisLockStore], key: str
) -> None:
    alias, _ = direct
    held = lock(key, ttl=30, store=alias)
    assert held.acquire()
    owner = held.owner
    server.kill()
    with pytest.raises(LockStoreUnavailable, match=r"cannot use Redis .*ConnectionError"):
        held.release()
    assert held.held and held.owner == owner  # not forgotten: Redis never confirmed
    with pytest.raises(LockStoreUnavailable):
        held.extend()
    with pytest.raises(LockStoreUnavailable):
        lock(key, store=alias).acquire()
    with pytest.raises(LockStoreUnavailable):
        lock(key, store=alias).acquire(timeout=1)
    calls: list[int] = []
    with pytest.raises(LockStoreUnavailable):
        lock(key, store=alias).run(lambda: calls.append(1))
    assert calls == []
    with pytest.raises(LockStoreUnavailable):
        held.info()


def test_restarted_server_works_again(
    server: RedisServer, direct: tuple[str, RedisLockStore], key: str
) -> None:
    alias, _ = direct
    before = lock(key, store=alias)
    assert before.run(lambda: 1) == (True, 1)
    server.kill()
    with pytest.raises(LockStoreUnavailable):
        lock(key, store=alias).acquire()
    server.start()
    handle = lock(key, ttl=30, store=alias)
    assert handle.acquire()  # the pool reconnects its stale sockets by itself
    assert not lock(key, store=alias).acquire()
    # The restarted server kept nothing (no persistence), fence counters included; fences
    # must still grow, or a stale holder from before the restart could pass a fence check.
    # (A counter that expired a day after its key's last use is the same case.)
    assert handle.fence is not None and before.fence is not None
    assert handle.fence > before.fence
    assert handle.release()


def test_killed_server_wakes_a_waiter_with_store_unavailable_not_a_timeout(
    server: RedisServer, direct: tuple[str, RedisLockStore], key: str
) -> None:
    alias, store = direct
    holder = lock(key, ttl=30, store=alias)
    assert holder.acquire()
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(lock(key, store=alias).acquire(timeout=20, retry_delay=10))
        except LockStoreUnavailable as exc:
            outcome.append(exc)

    with store.watch(key):  # start the listener so the waiter sleeps on push
        deadline = time.monotonic() + 5
        while not store.push_wakeups and time.monotonic() < deadline:
            time.sleep(0.01)
    assert store.push_wakeups
    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    server.kill()
    thread.join(10)
    assert outcome and isinstance(outcome[0], LockStoreUnavailable), outcome
    assert time.monotonic() - killed_at < 5, "the waiter slept on instead of hearing the outage"
    # The listener knows it lost its subscription: at once, though not necessarily before
    # the waiter (which may have heard of the outage through its own attempt first).
    deadline = time.monotonic() + 2
    while store.push_wakeups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store.push_wakeups
    server.start()
    deadline = time.monotonic() + 10
    while not store.push_wakeups and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.push_wakeups, "the listener did not resubscribe after the restart"


def test_lost_acquire_reply_is_an_error_and_a_retry_with_the_same_owner_is_safe(
    proxy: FaultyProxy, proxied: tuple[str, RedisLockStore], key: str
) -> None:
    alias, store = proxied
    proxy.mode = "drop_replies"
    with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
        store.acquire(key, "a" * 32, "h", 30)
    proxy.mode = "pass"
    # The script ran: the key is held, by exactly the owner whose reply was lost.
    assert not lock(key, store=alias).acquire()
    retried = store.acquire(key, "a" * 32, "h", 30)
    info = store.get(key)
    assert retried.fence is not None and info is not None
    assert info.owner == "a" * 32 and info.fence == retried.fence
    assert store.release(key, "a" * 32)


def test_handle_retry_after_a_lost_acquire_reply_gets_the_lock_instead_of_stranding_it(
    proxy: FaultyProxy, proxied: tuple[str, RedisLockStore], key: str
) -> None:
    alias, _ = proxied
    handle = lock(key, ttl=30, store=alias)
    proxy.mode = "drop_replies"
    with pytest.raises(LockStoreUnavailable):
        handle.acquire()
    proxy.mode = "pass"
    assert not lock(key, store=alias).acquire()  # the attempt whose reply was lost took it
    assert handle.acquire()  # the handle retries as the same owner and gets it back
    assert handle.release()
    assert lock(key, store=alias).run(lambda: 1) == (True, 1)


def test_lost_release_reply_keeps_the_owner_and_never_gives_two_owners(
    proxy: FaultyProxy, proxied: tuple[str, RedisLockStore], key: str
) -> None:
    alias, store = proxied
    held = lock(key, ttl=30, store=alias)
    assert held.acquire()
    proxy.mode = "drop_replies"
    with pytest.raises(LockStoreUnavailable):
        held.release()
    assert held.held  # the handle could not know the release happened, so it keeps the owner
    proxy.mode = "pass"
    assert held.release() is False  # Redis had released it: nothing is stranded
    other = lock(key, ttl=30, store=alias)
    assert other.acquire() and other.fence is not None and other.fence > (held.fence or 0)
    info = store.get(key)
    assert info is not None and info.owner == other.owner
    assert other.release()


def test_a_lost_release_reply_is_not_retried_behind_our_back_by_the_cache_client(
    proxy: FaultyProxy, key: str
) -> None:
    """A project may give its django-redis pool retries; a release retried after its reply was
    lost finds its own release done and would report the lock lost. The scripts skip those
    retries: the caller hears of the outage and Redis has released the lock once."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    caches = {
        **settings.CACHES,
        "faulty": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": proxy.url,
            "OPTIONS": {
                "SOCKET_TIMEOUT": 1,
                "CONNECTION_POOL_KWARGS": {"retry": Retry(NoBackoff(), 3)},
            },
        },
    }
    with override_settings(CACHES=caches):
        store = RedisLockStore(f"fault-{uuid.uuid4().hex[:8]}", {"CONNECTION": "faulty"})
        with serving(store) as alias:
            check_lost_release_reply(proxy, store, key)
            assert lock(key, store=alias).run(lambda: 1) == (True, 1)


def test_stalled_connection_times_out_with_a_clear_error_and_no_double_owner(
    proxy: FaultyProxy, proxied: tuple[str, RedisLockStore], key: str
) -> None:
    alias, _ = proxied
    held = lock(key, ttl=30, store=alias)
    assert held.acquire()
    proxy.mode = "stall"
    started = time.monotonic()
    stalled = lock(key, store=alias)
    with pytest.raises(LockStoreUnavailable, match=r"Timeout"):
        stalled.acquire()
    assert time.monotonic() - started < 4  # socket_timeout=1 in the URL
    with pytest.raises(LockStoreUnavailable, match=r"Timeout"):
        held.extend()
    assert held.held
    proxy.mode = "pass"
    # The proxy now forwards what it held back (the timed-out ACQUIRE and EXTEND) within a few
    # of its 10 ms polls: let them land first, or the late ACQUIRE can take the lock again
    # after the releases below and the last contender finds it held.
    time.sleep(0.3)
    contender: Lock = lock(key, store=alias)
    assert not contender.acquire()  # the stall did not free or duplicate the lock
    assert held.release()
    # The timed-out attempt may still reach Redis late and take the lock for its owner. A retry
    # on the same handle reuses that owner, so it gets the lock either way: never stranded,
    # never two owners.
    assert stalled.acquire()
    assert not contender.acquire()
    assert stalled.release()
    assert contender.acquire() and contender.release()


def test_connection_refused_from_the_start_is_store_unavailable(key: str) -> None:
    from .support.redis_servers import free_port

    with serving(_store(f"redis://127.0.0.1:{free_port()}/0")) as alias:
        started = time.monotonic()
        with pytest.raises(LockStoreUnavailable, match=r"Connection refused|Error 111"):
            lock(key, store=alias).acquire(timeout=5)
        assert time.monotonic() - started < 3  # an outage is not waited out like contention


def test_every_waiter_of_a_process_gets_unavailable_when_the_store_hangs(
    proxy: FaultyProxy, key: str
) -> None:
    # Waiters on one key take turns; the one whose turn it is hangs on the frozen store. The
    # others reach their deadline first: they must not report "held by someone else".
    store = _store(proxy.url + "?socket_timeout=3")
    with serving(store) as alias:
        assert lock(f"warm-up:{uuid.uuid4().hex}", store=alias).run(lambda: None).acquired
        proxy.mode = "stall"
        outcomes: list[object] = []

        def wait_for_it() -> None:
            try:
                outcomes.append(lock(key, ttl=30, timeout=1, store=alias).acquire())
            except LockStoreUnavailable as exc:
                outcomes.append(exc)

        waiters = [threading.Thread(target=wait_for_it) for _ in range(4)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(15)
        proxy.mode = "pass"
    assert len(outcomes) == 4
    assert all(isinstance(outcome, LockStoreUnavailable) for outcome in outcomes), outcomes


def test_a_grant_that_arrives_after_the_ttl_is_not_taken(
    proxy: FaultyProxy, proxied: tuple[str, RedisLockStore], key: str
) -> None:
    alias, store = proxied
    handle = lock(key, ttl=0.05, store=alias)
    result: list[bool] = []
    proxy.mode = "stall"
    attempt = threading.Thread(target=lambda: result.append(handle.acquire()))
    attempt.start()
    time.sleep(0.3)  # the request, and so the reply, is held past the 50 ms ttl
    proxy.mode = "pass"
    attempt.join(5)
    assert result == [False]
    assert not handle.held and handle.fence is None
    assert store.get(key) is None  # given back, not left to expire
    assert handle.acquire()  # and the handle may try again
    assert handle.release()


async def test_every_waiting_task_gets_unavailable_when_the_store_hangs(
    proxy: FaultyProxy, key: str
) -> None:
    store = _store(proxy.url + "?socket_timeout=3")
    with serving(store) as alias:
        assert (await lock(f"warm-up:{uuid.uuid4().hex}", store=alias).arun(lambda: None)).acquired
        proxy.mode = "stall"
        waiters = [lock(key, ttl=30, timeout=1, store=alias).aacquire() for _ in range(4)]
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        proxy.mode = "pass"
    assert all(isinstance(outcome, LockStoreUnavailable) for outcome in outcomes), outcomes


def _connected_listener(store: RedisLockStore, key: str | None = None) -> Any:
    """The store's listener once connected (for `key` a moment, if given: it starts it)."""
    with store.watch(key) if key is not None else contextlib.nullcontext():
        deadline = time.monotonic() + 10
        while not store.push_wakeups:
            assert time.monotonic() < deadline, "the listener never connected"
            time.sleep(0.01)
    assert store._listener is not None
    return store._listener


def _reading_waiter(
    store: RedisLockStore, listener: Any, key: str, seconds: float
) -> tuple[threading.Thread, list[float]]:
    """A thread waiting `seconds` for `key` (`waiting_in_thread`), once it reads the
    listener's connection itself (`read_here`). A waiting thread that finds the connection
    busy (the listener's own thread dispatching, say, the key's subscription) sleeps on the
    board instead, as it may: that one is woken and another started, three times at most."""
    for _ in range(3):
        thread, waited = waiting_in_thread(store, key, seconds)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if listener._reading.locked():
                return thread, waited
            time.sleep(0.001)
        store.wake_board.wake(key)
        thread.join(10)
    raise AssertionError("no waiting thread read the listener's connection")


def test_a_listener_that_stops_while_a_waiting_thread_reads_its_connection_leaves_it_closed(
    direct: tuple[str, RedisLockStore], key: str
) -> None:
    # A thread waiting for a key reads the listener's connection itself (`read_here`). The
    # listener giving that connection up (stopped here; or a dead link) gives it back to the
    # client's pool, closed: the waiting thread must not go on reading it, nor reopen it (a
    # command that got it from the pool would have its reply read by the waiting thread).
    _, store = direct
    listener = _connected_listener(store, key)
    conn = listener._conn
    thread, waited = _reading_waiter(store, listener, key, 3.0)
    store.stop_listener()
    time.sleep(0.3)
    assert conn._sock is None, "the waiting thread reopened the connection given back"
    client = store.client()
    for _ in range(5):
        assert client.ping()
    thread.join(10)
    assert waited


def test_a_listener_whose_connection_a_reading_thread_closed_subscribes_again(
    direct: tuple[str, RedisLockStore], key: str
) -> None:
    # redis-py closes a connection whose read fails (a reset link): a waiting thread that
    # reads the listener's connection (`read_here`) may do so behind the listener's back.
    # The listener must not let redis-py reopen it silently on its next command (subscribed
    # to nothing but that command's channel, while it believes itself subscribed): it
    # reconnects, subscribed to everything again.
    _, store = direct
    client = store.client()
    channels = [store.wake_prefix, store.wake_prefix, store.release_channel(key)]
    with store.watch(key):
        listener = _connected_listener(store)
        channels[0] += listener.address
        channels[1] += listener.address + ":grant"
        with listener._reading:  # as a waiting thread reading the connection holds it
            listener.interrupt()  # as it does: the listener's thread leaves the socket alone
            time.sleep(0.2)
            listener._conn.disconnect()  # what redis-py does when that thread's read fails
            with store.watch(key + ":other"):  # the listener subscribes to a new key
                time.sleep(0.2)
        deadline = time.monotonic() + 10
        while [count for _, count in client.pubsub_numsub(*channels)] != [1, 1, 1]:
            assert time.monotonic() < deadline, client.pubsub_numsub(*channels)
            time.sleep(0.01)


def test_a_waiting_thread_whose_read_of_the_listener_ends_early_waits_no_longer_than_asked(
    direct: tuple[str, RedisLockStore], key: str
) -> None:
    # The waiting thread reads the listener's connection (`read_here`) until the listener
    # gives it up (stopped here): it then sleeps what is left of its wait, not all of it
    # again (an acquire's pause would outlast its timeout).
    _, store = direct
    listener = _connected_listener(store, key)
    thread, waited = _reading_waiter(store, listener, key, 4.0)
    time.sleep(2.0)
    store.stop_listener()
    thread.join(10)
    assert waited and waited[0] < 5.0, waited  # 4 s asked; 6 s when it slept 4 s again


def test_a_grant_message_heard_on_a_replica_is_not_taken_for_a_carried_grant(
    key: str,
) -> None:
    # Redis passes a PUBLISH on to its replicas' subscribers whatever it counted itself. A
    # listener left on a replica (an old master demoted without its clients cut, behind a
    # proxy or a DNS name that moved) while the process's commands reach the master must
    # not hear a grant the master counted nobody for: that grant was written for 2 s at
    # most, not for the waiter's ttl.
    master = RedisServer("--repl-diskless-sync-delay", "0").start()
    replica = RedisServer("--replicaof", "127.0.0.1", str(master.port)).start()
    proxy = FaultyProxy(replica.port)
    store = _store(proxy.url + "?socket_timeout=1")
    direct = _store(master.url + "?socket_timeout=1")
    try:
        deadline = time.monotonic() + 20
        while "master_link_status:up" not in replica.cli("INFO", "replication"):
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)
        with serving(store) as alias:
            store.ensure_listener()  # on the replica
            while not store.listener_ready():
                assert time.monotonic() < deadline, "the listener never connected"
                time.sleep(0.01)
            proxy.target_port = master.port  # every command from now on: the master
            assert direct.acquire(key, "a" * 32, "holder", 30).acquired
            waiter = lock(key, ttl=30, holder="waiter", store=alias)
            got: list[bool] = []
            thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=10)))
            thread.start()
            while not direct.client().llen(direct.lock_name(key) + ":line"):
                assert time.monotonic() < deadline, "the waiter never stood in line"
                time.sleep(0.01)
            assert direct.release(key, "a" * 32)
            thread.join(15)
            assert got == [True]
            held = direct.get(key)
            assert held is not None and held.owner == waiter.owner
            assert held.expires_in > 5, held  # Redis keeps it as long as the waiter believes
            assert waiter.release()
    finally:
        direct.close()
        proxy.close()
        replica.stop()
        master.stop()
