"""PostgreSQL releases do not wait for the WAL flush (issue 37, item 1), on a server of the
test's own (tests/support/pg_server.py) that is crashed and restarted.

A release commits without waiting for its WAL record to reach the disk, so a crash right after
it may lose it: the lock then stays held, by nobody, until its ttl, and is never granted to
two. Every later synchronous commit flushes the WAL past the release first, so an acquire that
returned cannot survive a crash that the release before it did not. To crash in that moment
every time, the server's WAL writer is paused before the release (nothing flushes an
asynchronous commit then), and every process of the server is killed right after it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections

from django_keel_lock.models import Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.dialects.postgresql import (
    LISTENER_SQL,
    grant_channel,
    read_grant,
)
from tests.conftest import skip_or_fail
from tests.support.pg_server import PgServer, pg_bin, pg_server
from tests.test_database_faults import wait_until

TTL = 3.0


@pytest.fixture(scope="module")
def server(_databases: None) -> Iterator[PgServer]:
    if pg_bin() is None:
        skip_or_fail("PostgreSQL's server binaries are not installed (apt-get install postgresql)")
    with pg_server() as running:
        connections.settings["crashing"] = {**connections.settings["postgres"], **running.settings}
        try:
            call_command("migrate", "django_keel_lock", database="crashing", verbosity=0)
            connections["crashing"].close()
            yield running
        finally:
            connections["crashing"].close()
            del connections["crashing"]
            del connections.settings["crashing"]


@pytest.fixture
def store(server: PgServer) -> Iterator[DatabaseLockStore]:
    opened = DatabaseLockStore("crashing", {"DATABASE": "crashing"})  # DURABLE: the default
    yield opened
    opened.close()


def _owner() -> str:
    return uuid.uuid4().hex


def _crash(server: PgServer, store: DatabaseLockStore) -> None:
    """Kill the server (its WAL writer paused before: see the module), drop the store's
    connections to it, and start it again: crash recovery replays the WAL on disk."""
    server.crash()
    store.close()
    server.start()


def test_a_release_lost_to_a_crash_frees_the_lock_at_its_ttl_and_grants_nobody_twice(
    server: PgServer, store: DatabaseLockStore
) -> None:
    key, a, b = f"flush:{uuid.uuid4().hex}", _owner(), _owner()
    taken = store.acquire(key, a, "a", TTL)
    assert taken.fence is not None
    expires = time.monotonic() + TTL
    server.pause_wal_writer()
    assert store.release(key, a)
    _crash(server, store)
    # The release did not reach the disk (a release that waited for the flush would have):
    # the lock is still a's, and nobody else gets it before its ttl.
    info = store.get(key)
    assert info is not None and info.owner == a, info
    refused = store.acquire(key, b, "b", 30)
    assert not refused.acquired and refused.retry_in is not None
    assert refused.retry_in <= TTL
    while time.monotonic() < expires:
        time.sleep(0.05)
    later = store.acquire(key, b, "b", 30)
    assert later.fence is not None and later.fence > taken.fence
    assert store.release(key, b)


def test_a_take_after_an_unflushed_release_survives_the_crash_and_the_release_with_it(
    server: PgServer, store: DatabaseLockStore
) -> None:
    """c's acquire waits for its flush, which carries a's release before it: after the crash
    the lock is c's alone, as when it returned, with its fence."""
    key, a, c, d = f"flush:{uuid.uuid4().hex}", _owner(), _owner(), _owner()
    first = store.acquire(key, a, "a", 30)
    server.pause_wal_writer()
    assert store.release(key, a)
    second = store.acquire(key, c, "c", 30)
    assert second.fence is not None and first.fence is not None and second.fence > first.fence
    _crash(server, store)
    info = store.get(key)
    assert info is not None and (info.owner, info.fence) == (c, second.fence), info
    assert not store.acquire(key, d, "d", 30).acquired
    assert not store.release(key, a) and store.release(key, c)


def test_an_acquire_and_an_extend_still_wait_for_the_flush(
    server: PgServer, store: DatabaseLockStore
) -> None:
    """What a crash cannot cost: an acquire or extend that returned survives it."""
    key, a = f"flush:{uuid.uuid4().hex}", _owner()
    assert store.acquire(key, a, "a", 5).acquired
    server.pause_wal_writer()
    assert store.extend(key, a, 60)
    _crash(server, store)
    info = store.get(key)
    assert info is not None and info.owner == a and info.expires_in > 30, info
    assert store.release(key, a)


def test_not_durable_acquire_and_extend_do_not_wait_for_the_flush(
    server: PgServer, store: DatabaseLockStore
) -> None:
    """DURABLE: False, what it trades: with the WAL writer paused, an acquire and an extend that
    returned are lost to the crash (neither waited for the flush). The durable `store` takes
    the lock the extend is of, flushed."""
    fast = DatabaseLockStore("crashing", {"DATABASE": "crashing", "DURABLE": False})
    try:
        extended, taken, a = f"flush:{uuid.uuid4().hex}", f"flush:{uuid.uuid4().hex}", _owner()
        assert store.acquire(extended, a, "a", 5).acquired
        server.pause_wal_writer()
        assert fast.extend(extended, a, 60)
        assert fast.acquire(taken, a, "a", 30).acquired
        fast.close()
        _crash(server, store)
        assert store.get(taken) is None
        info = store.get(extended)
        assert info is not None and info.owner == a and info.expires_in <= 5, info
    finally:
        fast.close()


def test_a_release_that_hands_the_lock_over_waits_for_the_flush(
    server: PgServer, store: DatabaseLockStore
) -> None:
    """A release that grants the lock to the first in line is an acquire for that waiter:
    lost to a crash, the waiter would go on holding a lock the database gave back to its
    releaser (and then, at its ttl, to anyone). It survives the crash, as an acquire does."""
    key, a, b, c = f"flush:{uuid.uuid4().hex}", _owner(), _owner(), _owner()
    assert store.acquire(key, a, "a", TTL).acquired
    assert not store.acquire_queued(key, b, "b", 30).acquired  # b stands in the line
    server.pause_wal_writer()
    assert store.release(key, a)
    granted = store.get(key)
    assert granted is not None and granted.owner == b, granted
    _crash(server, store)
    info = store.get(key)
    assert info is not None and (info.owner, info.fence) == (b, granted.fence), info
    assert not store.acquire(key, c, "c", 30).acquired
    assert not store.release(key, a)
    assert store.acquire_queued(key, b, "b", 30).fence == granted.fence  # taken up
    assert store.release(key, b)


def _listening(server: PgServer, address: str) -> Any:
    """A connection of the test's own to `server` that listens as a waiting process's
    listener does, at wake address `address`, taking capped grants (`LISTENER_SQL`)."""
    import psycopg

    raw = psycopg.connect(
        host="127.0.0.1", port=server.port, user=server.user, dbname="postgres", autocommit=True
    )
    raw.execute(f"LISTEN {grant_channel(address)}")
    raw.execute(LISTENER_SQL)
    return raw


def test_a_capped_grant_lost_to_a_crash_is_not_confirmed_and_nobody_takes_the_lock_meanwhile(
    server: PgServer, store: DatabaseLockStore
) -> None:
    """A durable release may hand the lock over without waiting for the flush, to a waiter
    whose process listens for it (migration 0011): the waiter believes it for what was left
    of the releaser's lease, and confirms it with an extend at once. Lost to a crash (before
    the confirmation), the grant is not there to confirm: the waiter's extend is refused (it
    is told the lock was lost), and the row, the releaser's again, keeps every other
    acquirer out for at least as long as the waiter believed in the grant."""
    a, b, c = _owner(), _owner(), _owner()
    raw = _listening(server, "cafe")
    try:
        (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
        for _ in range(3):  # a draw that writes the sequence's WAL: flushed, again
            key = f"flush:{uuid.uuid4().hex}"
            assert store.acquire(key, a, "a", TTL).acquired
            asked = time.monotonic()
            assert not store.acquire_queued(key, b, "b", TTL).acquired
            places = Waiter.objects.using("crashing").filter(key=key, owner=b)
            assert places.update(address="cafe", listener=pid)
            server.pause_wal_writer()
            assert store.release(key, a)
            (note,) = raw.notifies(timeout=2, stop_after=1)
            _, owner, fence, good_for = read_grant(note.payload)
            assert owner == b
            if good_for is not None:
                break
            _crash(server, store)  # wakes the WAL writer again
            raw.close()
            raw = _listening(server, "cafe")
            (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
        else:
            raise AssertionError("no release handed the lock over capped")
        believed = asked + good_for  # b counts from its refused attempt
    finally:
        raw.close()
    _crash(server, store)
    info = store.get(key)
    assert info is not None and info.owner == a, info  # the grant did not reach the disk
    assert not store.extend(key, b, TTL)  # b's confirmation: refused, b's lock is lost
    while time.monotonic() < believed:
        assert not store.acquire(key, c, "c", 30).acquired
        time.sleep(0.1)
    later = store.acquire(key, c, "c", 30)  # a's lease, at the latest
    deadline = time.monotonic() + TTL
    while not later.acquired and time.monotonic() < deadline:
        time.sleep(0.05)
        later = store.acquire(key, c, "c", 30)
    assert later.fence is not None and later.fence > fence
    assert store.release(key, c)


def _capped_hand_over(store: DatabaseLockStore, raw: Any, alias: str, address: str) -> bool:
    """A hand-over through `store` to a waiter whose place names `raw`, a listener at
    `address`: whether the grant came capped."""
    key, a, b = f"flush:{uuid.uuid4().hex}", _owner(), _owner()
    (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
    assert store.acquire(key, a, "a", 30).acquired
    assert not store.acquire_queued(key, b, "b", 30).acquired
    places = Waiter.objects.using(alias).filter(key=key, owner=b)
    assert places.update(address=address, listener=pid)
    assert store.release(key, a)
    (note,) = raw.notifies(timeout=2, stop_after=1)
    _, owner, _, good_for = read_grant(note.payload)
    assert owner == b and store.release(key, b)
    return good_for is not None


def test_no_grant_is_capped_under_synchronous_replication(server: PgServer) -> None:
    """With a synchronous standby named, a failover may promote a server whose WAL is behind
    this one's disk: the release then hands over as before 0011, waiting for the flush. (The
    store's sessions commit with `synchronous_commit = local` here: there is no standby.)
    Without one, the same hand-overs come capped (most of them: not where the WAL was not
    on disk yet, or the fence's draw wrote some)."""
    import psycopg

    admin = psycopg.connect(
        host="127.0.0.1", port=server.port, user=server.user, dbname="postgres", autocommit=True
    )
    options = {"options": "-c synchronous_commit=local"}
    connections.settings["replicated"] = {**connections.settings["crashing"], "OPTIONS": options}
    replicated = DatabaseLockStore("replicated", {"DATABASE": "replicated"})
    raw = _listening(server, "beef")
    shown = "SELECT current_setting('synchronous_standby_names')"
    try:
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
        admin.execute("SELECT pg_reload_conf()")
        assert wait_until(lambda: raw.execute(shown).fetchone()[0] == "standby", 10)
        assert not any(_capped_hand_over(replicated, raw, "replicated", "beef") for _ in range(5))
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        assert wait_until(lambda: raw.execute(shown).fetchone()[0] == "", 10)
        assert any(_capped_hand_over(replicated, raw, "replicated", "beef") for _ in range(10))
    finally:
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()
        raw.close()
        replicated.close()
        connections["replicated"].close()
        del connections["replicated"]
        del connections.settings["replicated"]
