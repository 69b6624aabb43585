"""What the stores promise about fences and waking waiters at their edges, as the docs state it
(docs/guarantees.md, docs/capabilities.md): a Redis fence after a failover that lost the key's
last fence; a MariaDB waiter whose process found every slot of the key's doorbell taken; a
writer (an exclusive acquirer that found readers) and the line of waiters."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connections

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.stores import DatabaseLockStore, RedisLockStore
from django_keel_lock.stores.base import EXCLUSIVE, LockStore
from django_keel_lock.stores.database.dialects.mysql import BELL_SLOTS, MySQLDialect
from django_keel_lock.stores.database.listener import MariaDBListener

from .conftest import needs, needs_store, serving, store_params
from .support.redis_servers import REDIS_SERVER, RedisServer, redis_server, wait_for
from .test_database_faults import wait_until
from .test_database_wakeups import another_store, listener_id, listening, waiting, waiting_flag
from .test_line import QUEUE_STORES


def _fence_of_one_acquisition(alias: str, key: str) -> int:
    handle = lock(key, ttl=30, store=alias)
    assert handle.acquire()
    fence = handle.fence
    assert fence is not None and handle.release()
    return fence


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
@needs(bool(shutil.which("cc") or shutil.which("gcc")), "a C compiler (the shifted clock)")
@pytest.mark.parametrize(
    ("behind", "goes_back"), [(0, False), (3600, True)], ids=["clocks-agree", "clock-1h-behind"]
)
def test_redis_fence_after_a_failover_that_lost_it_goes_back_only_onto_a_clock_behind(
    key: str, behind: int, goes_back: bool
) -> None:
    """A replica stops following its primary (a partition), the primary hands the key's next
    fence (its counter's write never reaches the replica), and the replica becomes the primary.
    Its next fence is one above the last counter it has, and at least its clock in µs: above
    the lost fence when the clocks agree, below it when the new primary's clock is behind by
    more than the time since the lost fence (docs/guarantees.md states the exception)."""
    with redis_server() as primary:
        replica = RedisServer(
            "--replicaof", "127.0.0.1", str(primary.port), clock_shift=-behind
        ).start()
        try:
            offset = int(replica.cli("time").split()[0]) - time.time()
            assert abs(offset + behind) < 60, f"the replica's clock is {offset:.0f} s off"
            wait_for(lambda: "master_link_status:up" in replica.cli("info", "replication"))
            with serving(
                RedisLockStore(f"old-{uuid.uuid4().hex[:8]}", {"URL": primary.url})
            ) as old:
                first = _fence_of_one_acquisition(old, key)
                # The replica has the counter (WAIT from another connection would not wait for
                # the store's writes): only the next fence is lost.
                (counter,) = primary.cli("--scan", "--pattern", "*:fence").split()
                wait_for(lambda: replica.cli("get", counter).strip() == str(first))
                replica.cli("replicaof", "no", "one")  # the partition, then the promotion
                wait_for(lambda: "role:master" in replica.cli("info", "replication"))
                lost = _fence_of_one_acquisition(old, key)  # only the old primary has it
            with serving(
                RedisLockStore(f"new-{uuid.uuid4().hex[:8]}", {"URL": replica.url})
            ) as new:
                after = _fence_of_one_acquisition(new, key)
        finally:
            replica.stop()
    assert first < lost
    if goes_back:
        assert after == first + 1 < lost, (first, lost, after)
    else:
        assert after > lost, (first, lost, after)


@contextmanager
def doorbell_slots_taken(key: str, count: int) -> Iterator[None]:
    """The first `count` slots of `key`'s MariaDB doorbell held by a connection of their own
    (idle: a ring's KILL QUERY finds nothing to interrupt there), as `count` other waiting
    processes' listeners would hold them."""
    base = connections["mariadb"]
    raw = base.get_new_connection(base.get_connection_params())
    try:
        cursor = raw.cursor()
        for name in MySQLDialect().bell_names(key)[:count]:
            cursor.execute("SELECT GET_LOCK(%s, 0)", (name,))
            assert cursor.fetchone()[0] == 1
        yield
    finally:
        raw.close()


def _subscribed(store: DatabaseLockStore, key: str) -> bool:
    listener = store._listener
    return listener is not None and key in listener.subscribed


@needs_store("mariadb")
@pytest.mark.parametrize("others", [BELL_SLOTS - 1, BELL_SLOTS], ids=["a-slot-left", "all-taken"])
def test_mariadb_waiter_past_the_doorbells_slots_wakes_at_its_listeners_next_nap(
    key: str, others: int
) -> None:
    """A semaphore waiter in another process (a store of its own), with a holder's ttl of 30 s
    and retry_delay 5 s: rung at once while its process finds a slot of the key's doorbell;
    with every slot taken by other processes, at its listener's next nap, which began when it
    subscribed (docs/capabilities.md, Push wake-ups)."""
    held = semaphore(key, limit=1, ttl=30, store="mariadb")
    assert held.acquire()
    with doorbell_slots_taken(key, others), another_store() as waiting_store:
        with waiting(semaphore(key, limit=1, ttl=30, store=waiting_store.alias), 5) as acquired:
            assert wait_until(lambda: _subscribed(waiting_store, key) and waiting_flag(key), 10)
            assert (listener_id(waiting_store) in listening(key)) is (others < BELL_SLOTS)
            time.sleep(1.0)  # its attempt after the nap began (the nap wakes it) is over
            released_at = time.monotonic()
            assert held.release()
            assert wait_until(lambda: acquired, 20), "the waiter never got the permit"
            woke_after = acquired[0] - released_at
    if others < BELL_SLOTS:
        assert woke_after < 1.0
    else:
        assert 1.0 < woke_after < MariaDBListener.nap + 5.0


@pytest.mark.parametrize("alias", store_params(QUEUE_STORES))
def test_writer_takes_a_free_lock_without_looking_at_the_line(alias: str, key: str) -> None:
    """A free lock whose line has a live first waiter goes to that waiter among the line's
    attempts (`acquire_queued`), but a writer's attempt (`acquire_permit` in EXCLUSIVE mode:
    an exclusive acquirer that found readers, for the rest of its wait) takes it: the line
    orders the waiters kept out by an exclusive holder, nothing else (docs/capabilities.md,
    Waiters in line). Order only: the first waiter is refused, never let in beside it. A store
    that `hands_off` gives the lock to the first in line in the release itself: never free."""
    store = get_lock_store(alias)
    assert store.acquire(key, "holder", "holder", 30).acquired
    # The waiters wait in this process, as waiters do (Redis gives back a grant carried to a
    # process where nobody waits as its owner).
    with store.watch(key, "first"), store.watch(key, "later"):
        _writer_and_line(store, key)


def _writer_and_line(store: LockStore, key: str) -> None:
    assert store.acquire_queued(key, "first", "first", 30).fence is None  # stands in line
    assert store.release(key, "holder")
    assert store.acquire_queued(key, "later", "later", 30).fence is None  # the line's order
    if store.hands_off:
        # The release handed the lock over to the first in line: the writer finds it held.
        assert store.acquire_permit(key, "writer", "writer", 30, EXCLUSIVE, 2.0).fence is None
        assert store.acquire_queued(key, "first", "first", 30).fence is not None
        assert store.release(key, "first")  # handed over to "later", which gives up
        store.leave_queue(key, "later")
        assert store.get(key) is None
        return
    taken = store.acquire_permit(key, "writer", "writer", 30, EXCLUSIVE, 2.0)
    assert taken.fence is not None
    assert store.acquire_queued(key, "first", "first", 30).fence is None
    assert store.release(key, "writer")
    assert store.acquire_queued(key, "first", "first", 30).fence is not None
    assert store.release(key, "first")
    store.leave_queue(key, "later")
