"""Redis MIN_REPLICAS: each acquire and extend waits (WAIT) for that many replicas, and a lock
fewer acknowledged is given back with LockStoreUnavailable. On a primary and a replica of
the test's own (tests/support/redis_servers.py); the replica is stopped with SIGSTOP."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_keel_lock import LockStoreUnavailable, lock, set_lock_store
from django_keel_lock.stores import RedisLockStore
from django_keel_lock.stores.base import semaphore_mode
from django_keel_lock.stores.redis.results import RedisResults
from django_keel_lock.stores.results import StoredResult
from tests.support.redis_servers import RedisServer, wait_for

#: The test settings' cache shares the URL's database: not what these tests are about.
W005 = "django_keel_lock.W005"


@pytest.fixture(scope="module")
def primary() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica, in sync."""
    main = RedisServer().start()
    copy = RedisServer("--replicaof", "127.0.0.1", str(main.port))
    try:
        copy.start()
        wait_for(lambda: "master_link_status:up" in copy.cli("info", "replication"))
        yield main, copy
    finally:
        copy.stop()
        main.stop()


def _store(url: str, min_replicas: int) -> RedisLockStore:
    options = {"URL": url, "MIN_REPLICAS": min_replicas, "SOCKET_TIMEOUT": 1}
    return RedisLockStore("replicated", options)


def test_acquire_and_extend_pass_while_the_replica_acknowledges(
    primary: tuple[RedisServer, RedisServer], key: str
) -> None:
    store = _store(primary[0].url, 1)
    try:
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        assert store.extend(key, "owner-a", 60)
        assert primary[1].cli("exists", store._names(key)[0]).strip() == "1"  # it is there
        assert store.release(key, "owner-a")
    finally:
        store.close()


@contextmanager
def stopped(copy: RedisServer) -> Iterator[None]:
    """The replica stopped (SIGSTOP: connected, silent) while the block runs; then in sync."""
    assert copy.process is not None
    os.kill(copy.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(copy.process.pid, signal.SIGCONT)
    wait_for(lambda: "master_link_status:up" in copy.cli("info", "replication"))


def test_a_stopped_replica_makes_acquire_give_the_lock_back_and_raise(
    primary: tuple[RedisServer, RedisServer], key: str
) -> None:
    main, copy = primary
    store, plain = _store(main.url, 1), _store(main.url, 0)
    try:
        with stopped(copy):
            started = time.monotonic()
            with pytest.raises(LockStoreUnavailable, match=r"0 of the 1 replicas \(MIN_REPLICAS\)"):
                store.acquire(key, "owner-a", "a", 30)
            assert time.monotonic() - started < 1.5  # WAIT gives up at half of SOCKET_TIMEOUT
            assert store.get(key) is None  # given back: anyone can take it
            # Without MIN_REPLICAS the same server grants it: what the option changes.
            assert plain.acquire(key, "owner-b", "b", 30).fence is not None
    finally:
        store.close()
        plain.close()


def test_an_extend_short_of_replicas_raises_and_leaves_the_lock_to_its_holder(
    primary: tuple[RedisServer, RedisServer], key: str
) -> None:
    """The holder of a lock whose extend raised LockStoreUnavailable still counts on it until
    the expiry it was last told: giving the lock back then would let another process take it
    while the holder believes it holds it (two holders). The extend raises and the lock stays;
    the replicas have the expiry the holder counts on."""
    main, copy = primary
    store, other = _store(main.url, 1), _store(main.url, 0)
    alias = f"replicated-{os.getpid()}"
    set_lock_store(store, alias)
    try:
        with lock(key, store=alias, ttl=30) as held:
            with stopped(copy):
                with pytest.raises(LockStoreUnavailable, match="0 of the 1 replicas"):
                    held.extend(60)
                assert held.held  # it still counts on the expiry of its acquire
                assert other.acquire(key, "owner-b", "b", 30).fence is None  # nobody else
                with pytest.raises(LockStoreUnavailable, match="0 of the 1 replicas"):
                    asyncio.run(store.aextend(key, held.owner or "", 60))
                assert other.acquire(key, "owner-b", "b", 30).fence is None
            info = store.get(key)
            assert info is not None and info.owner == held.owner
        permits = f"{key}:permits"
        assert store.acquire_permit(permits, "owner-p", "p", 30, semaphore_mode(1)).fence
        with stopped(copy):  # a semaphore's permit likewise
            with pytest.raises(LockStoreUnavailable, match="keeps the expiry it had"):
                store.extend_permit(permits, "owner-p", 60)
            assert [each.owner for each in store.holders(permits)] == ["owner-p"]
        assert store.release_permit(permits, "owner-p")
    finally:
        set_lock_store(None, alias)
        store.close()
        other.close()


def test_a_stopped_replica_makes_async_acquire_raise_too(
    primary: tuple[RedisServer, RedisServer], key: str
) -> None:
    main, copy = primary
    store = _store(main.url, 1)
    try:
        with stopped(copy):
            with pytest.raises(LockStoreUnavailable, match="given back"):
                asyncio.run(store.aacquire(key, "owner-a", "a", 30))
            assert store.get(key) is None
    finally:
        store.close()
    store = _store(main.url, 1)
    try:
        assert asyncio.run(store.aacquire(key, "owner-a", "a", 30)).fence is not None
        assert asyncio.run(store.aextend(key, "owner-a", 30))
        assert store.release(key, "owner-a")
    finally:
        store.close()


def test_more_replicas_than_there_are_refuses_every_acquire(
    primary: tuple[RedisServer, RedisServer], key: str
) -> None:
    store = _store(primary[0].url, 2)
    try:
        with pytest.raises(LockStoreUnavailable, match="1 of the 2 replicas"):
            store.acquire(key, "owner-a", "a", 30)
        assert store.get(key) is None
    finally:
        store.close()


@pytest.mark.parametrize(
    ("value", "says"),
    [(-1, "whole number >= 0"), ("1", "whole number >= 0"), (True, "whole number >= 0")],
)
def test_a_bad_min_replicas_is_check_e014_and_refused(value: object, says: str) -> None:
    options = {"URL": "redis://127.0.0.1:6379/0", "MIN_REPLICAS": value}
    (message,) = [m for m in RedisLockStore.check_config("locks", options) if m.id != W005]
    assert message.id == "django_keel_lock.E014" and says in message.msg
    assert "KEEL_LOCK_STORES['locks'] OPTIONS MIN_REPLICAS" in message.msg
    with pytest.raises(ImproperlyConfigured, match=says):
        RedisLockStore("locks", options)


def test_min_replicas_with_cluster_is_check_e014() -> None:
    options = {"URL": "redis://127.0.0.1:7000/0", "CLUSTER": True, "MIN_REPLICAS": 1}
    (message,) = [m for m in RedisLockStore.check_config("locks", options) if m.id != W005]
    assert message.id == "django_keel_lock.E014" and "with CLUSTER" in message.msg


def test_an_idempotent_result_is_written_with_wait_and_one_short_of_replicas_is_warned_of(
    primary: tuple[RedisServer, RedisServer], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A result write (and the release it comes with) waits for MIN_REPLICAS as an acquire
    does: once it returns, the replica has the result. Short of acknowledgements, the result
    stays kept on the primary and the lock released (the request has answered), and a
    WARNING says a failover may lose it (a retry would then run again)."""
    main, copy = primary
    store = _store(main.url, 1)
    results = RedisResults(store)
    try:
        fence = store.acquire(key, "owner-a", "a", 30).fence
        assert fence is not None
        kept = StoredResult(key, "fp", fence, 201, b"paid")
        assert results.save_releasing(key, "owner-a", fence, kept, 60, store.release) == (
            True,
            True,
        )
        assert copy.cli("hget", f"{store._names(key)[0]}:result", "s").strip() == "201"
        assert "MIN_REPLICAS" not in caplog.text
        fence = store.acquire(key, "owner-b", "b", 30).fence
        assert fence is not None
        with stopped(copy), caplog.at_level(logging.WARNING, "django_keel_lock"):
            again = StoredResult(key, "fp", fence, 202, b"again")
            assert results.save_releasing(key, "owner-b", fence, again, 60, store.release) == (
                True,
                True,
            )
        assert "fewer than the 1 replicas of MIN_REPLICAS acknowledged it" in caplog.text
        assert store.get(key) is None  # released all the same
        found = results.get(key)
        assert found is not None and found.status == 202
    finally:
        store.close()
