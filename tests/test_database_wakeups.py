"""MariaDB's push wake-ups: a release that someone waited for rings the key's doorbell (see
`MySQLDialect`), so a waiter in another process wakes at once, not at its next poll (and
tests.test_database_store's test_waiter_in_another_process_wakes_on_release_not_on_its_poll);
a release nobody waited for costs nothing extra; a listener that loses its connection comes
back, and its waiters meanwhile still get the lock."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.models import Lock, Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.base import QUEUE_LEASE
from django_keel_lock.stores.database.listener import MariaDBListener

from .conftest import needs_store, serving
from .test_database_faults import wait_until

pytestmark = needs_store("mariadb")


def listening(key: str) -> list[int]:
    """The connection ids of the listeners (of any process) holding a slot of `key`'s
    doorbell, as a release's ring reads them."""
    store = get_lock_store("mariadb")
    assert isinstance(store, DatabaseLockStore)
    dialect = store.dialect
    with connections["mariadb"].cursor() as cursor:
        cursor.execute(dialect.ring_sql, dialect.bell_names(key))
        return [int(value) for value in cursor.fetchone() if value is not None]


def waiting_flag(key: str) -> bool:
    return Lock.objects.using("mariadb").filter(key=key, waiting=True).exists()


@contextmanager
def another_store() -> Iterator[DatabaseLockStore]:
    """A second store on the MariaDB database, registered under its own alias: its own wake
    board and listener, so it hears the other store's releases only as another process
    would, through the doorbell."""
    store = DatabaseLockStore(f"mariadb-other-{uuid.uuid4().hex[:8]}", {"DATABASE": "mariadb"})
    with serving(store):
        yield store


@contextmanager
def waiting(handle: Any, retry_delay: float) -> Iterator[list[float]]:
    """`handle` acquiring (timeout 20 s) in a thread while the block runs; yields the list
    that gets the monotonic time its acquire returned True. Released at the end."""
    acquired: list[float] = []

    def wait() -> None:
        if handle.acquire(timeout=20, retry_delay=retry_delay):
            acquired.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        yield acquired
    finally:
        thread.join(25)
        handle.release()


def woken(acquired: list[float], released_at: float, within: float) -> bool:
    """Whether the waiter got the lock less than `within` seconds after `released_at`."""
    wait_until(lambda: acquired, 20)
    return bool(acquired) and acquired[0] - released_at < within


def commands_of(store: DatabaseLockStore, call: Callable[[], object]) -> dict[str, int]:
    """Which statements `call` sends on this thread's connection of `store`, by the server's
    own counts: {"statements": all of them (Questions), "begin": ..., "update": ...,
    "kill": ..., "commit": ...}, the SHOWs that read them taken off."""
    conn, _ = store._connection()
    cursor = conn.wrapper.connection.cursor()
    names = {"Questions": "statements"} | {
        f"Com_{command}": command for command in ("begin", "update", "kill", "commit")
    }

    def counts() -> dict[str, int]:
        marks = ", ".join(["%s"] * len(names))
        cursor.execute(f"SHOW SESSION STATUS WHERE Variable_name IN ({marks})", list(names))
        return {names[name]: int(value) for name, value in cursor.fetchall()}

    first = counts()
    idle = {name: value - first[name] for name, value in counts().items()}  # the SHOW itself
    before = counts()
    call()
    after = counts()
    return {name: after[name] - before[name] - idle[name] for name in after}


def statements_of(store: DatabaseLockStore, call: Callable[[], object]) -> int:
    """How many statements `call` sends on this thread's connection of `store`."""
    return commands_of(store, call)["statements"]


def test_mariadb_release_nobody_waits_for_is_one_statement_and_one_waited_for_rings(
    key: str,
) -> None:
    store = get_lock_store("mariadb")
    assert isinstance(store, DatabaseLockStore)
    assert store.acquire(key, "a", "a", 30).acquired
    assert statements_of(store, lambda: store.release(key, "a")) == 1
    assert store.acquire(key, "a", "a", 30).acquired
    assert not store.acquire(key, "b", "b", 30).acquired  # a waiter's attempt raises the flag
    assert waiting_flag(key)
    # The flag is up: the one statement frees nothing, and the one that frees the lock
    # unless a live waiter stands in line finds nobody there; then the read of the doorbell
    # (nobody listens to it: nothing to KILL).
    assert statements_of(store, lambda: store.release(key, "a")) == 3
    assert store.acquire(key, "a", "a", 30).acquired
    assert not store.acquire(key, "b", "b", 30).acquired
    # The next release of the key starts with that second statement: 2, as before hand-offs.
    assert statements_of(store, lambda: store.release(key, "a")) == 2
    assert store.acquire(key, "b", "b", 30).acquired  # another owner's take lowers the flag
    assert not waiting_flag(key)
    # Nothing was handed over: one statement, which frees the lock, and no ring.
    assert statements_of(store, lambda: store.release(key, "b")) == 1


def test_mariadb_ring_wakes_a_waiter_of_another_store_at_once(key: str) -> None:
    """Two stores in one process hear each other only through the doorbell, as two processes
    would; retry_delay 5 s and the holder's ttl of 30 s mean only a ring can wake it soon."""
    holder = lock(key, ttl=30, store="mariadb")
    assert holder.acquire()
    with another_store() as waiting_store:
        with waiting(lock(key, ttl=30, store=waiting_store.alias), 5) as acquired:
            assert wait_until(lambda: listening(key) and waiting_flag(key), 10)
            released_at = time.monotonic()
            assert holder.release()
            assert woken(acquired, released_at, 1.0)


def test_mariadb_release_hands_the_lock_over_and_interrupts_the_first_in_lines_listener_alone(
    key: str,
) -> None:
    """A release that finds a live waiter in the key's line hands the lock over to it in
    one transaction (a read of the lock row and the first in line, locked, with a fence
    drawn; the grant, a multi-table UPDATE), then KILLs that waiter's listener's nap once it
    committed, with no read of the doorbell: the listener reads the grant, and the waiter
    holds the lock with no call. The statement that frees a lock whose flag is down goes
    first, then the one that frees it unless a live waiter stands in line (two UPDATEs that
    find the line); once a release of the key handed it over, the next goes straight to the
    transaction."""
    store = get_lock_store("mariadb")
    assert isinstance(store, DatabaseLockStore)
    expected = {"begin": 1, "kill": 1, "commit": 1}
    places = Waiter.objects.using("mariadb").filter(key=key, fence__isnull=True)
    ready = places.exclude(address="").filter(listener__isnull=False)
    with another_store() as waiting_store:
        for statements, updates in ((7, 2), (5, 0)):
            holder = lock(key, ttl=30, store="mariadb")
            assert holder.acquire()
            waiter = lock(key, ttl=30, store=waiting_store.alias)
            with waiting(waiter, 5) as acquired:
                assert wait_until(lambda: ready.exists() and listening(key), 10)
                released_at = time.monotonic()
                counted = commands_of(store, holder.release)
                assert counted == {**expected, "statements": statements, "update": updates}
                assert woken(acquired, released_at, 1.0)
                info = store.get(key)
                assert info is not None and info.owner == waiter.owner
                assert info.fence == waiter.fence and info.expires_in > QUEUE_LEASE


@pytest.mark.parametrize("kind", ["semaphore", "writer"])
def test_mariadb_permit_release_that_frees_room_rings(key: str, kind: str) -> None:
    """A semaphore waiter wakes when a permit goes; a writer waiting for a reader when the
    reader goes (the permits' transaction raises the flag and its release reads it)."""
    if kind == "semaphore":
        held = semaphore(key, limit=1, ttl=30, store="mariadb")
    else:
        held = lock(key, ttl=30, store="mariadb", shared=True)
    assert held.acquire()
    with another_store() as waiting_store:
        if kind == "semaphore":
            waiter = semaphore(key, limit=1, ttl=30, store=waiting_store.alias)
        else:
            waiter = lock(key, ttl=30, store=waiting_store.alias)
        with waiting(waiter, 5) as acquired:
            assert wait_until(lambda: listening(key) and waiting_flag(key), 10)
            time.sleep(0.2)
            released_at = time.monotonic()
            assert held.release()
            assert woken(acquired, released_at, 1.0)


def test_mariadb_listener_whose_connection_is_killed_reconnects_and_waiters_get_the_lock(
    key: str,
) -> None:
    """While its connections are KILLed as soon as they subscribe, the listener is not
    `ready` and waiters poll (the holder's ttl is 30 s: trusting a dead doorbell would wait
    that long); once the killing stops, it subscribes again on a new connection."""
    holder = lock(key, ttl=30, store="mariadb")
    assert holder.acquire()
    with another_store() as waiting_store:
        with waiting(lock(key, ttl=30, store=waiting_store.alias), 0.2) as acquired:
            assert wait_until(lambda: listening(key), 10)
            assert isinstance(waiting_store._listener, MariaDBListener)
            assert waiting_store.push_wakeups
            first = listener_id(waiting_store)
            with killing_listeners(key, waiting_store) as seen_down:
                time.sleep(0.5)
                released_at = time.monotonic()
                assert holder.release()
                assert woken(acquired, released_at, 5.0)
            assert any(seen_down), "the listener stayed ready with its connection killed"
        # Waiting again: the listener is back, subscribed on a new connection.
        assert holder.acquire()
        try:
            with waiting(lock(key, ttl=30, store=waiting_store.alias), 5):
                assert wait_until(
                    lambda: waiting_store.push_wakeups and listener_id(waiting_store) != first, 15
                )
                assert wait_until(lambda: listener_id(waiting_store) in listening(key), 10)
                holder.release()
        finally:
            holder.release()


@contextmanager
def killing_listeners(key: str, store: DatabaseLockStore) -> Iterator[list[bool]]:
    """KILL the connection of every listener in `key`'s doorbell, over and over, while the
    block runs; yields, one per round, whether `store`'s listener was down."""
    stop = threading.Event()
    seen_down: list[bool] = []

    def kill() -> None:
        with connections["mariadb"].cursor() as cursor:
            while not stop.is_set():
                seen_down.append(not store.push_wakeups)
                for connection_id in listening(key):
                    try:
                        cursor.execute(f"KILL CONNECTION {connection_id}")
                    except Exception:
                        pass  # gone already
                time.sleep(0.005)
        connections["mariadb"].close()

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        yield seen_down
    finally:
        stop.set()
        killer.join(10)


def listener_id(store: DatabaseLockStore) -> Any:
    return getattr(store._listener, "connection_id", None)
