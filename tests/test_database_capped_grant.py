"""PostgreSQL's capped grants (migration 0011): a durable release hands the lock over to a
waiter whose process listens for it without waiting for the WAL flush; the waiter believes
it for what was left of the releaser's lease (`good_for`), and confirms it at once with a
durable extend. What a crash then costs is tests/test_database_release_flush.py's.

A release caps a grant only while every WAL record of the server is on disk, which another
suite's writes on the shared server keep from being true for long: the grants are handed
over on a server of this module's own (tests/support/pg_server.py), where only the tests
write."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.test import override_settings

from django_keel_lock import Lock, get_lock_store, lock
from django_keel_lock.models import Lock as LockRow
from django_keel_lock.models import Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.dialects.postgresql import (
    CAPPED_LOCK,
    LISTENER_LOCK,
    address_channel,
    grant_channel,
    read_grant,
)

from .conftest import empty_database, needs_store, skip_or_fail
from .support.pg_server import PgServer, pg_bin, pg_server
from .test_database_faults import wait_until
from .test_database_line import database_store_of, listening_at, postgres_connection
from .test_database_listener_park import holds_advisory

pytestmark = needs_store("postgres")

ADDRESS = "c0ffee"
#: The store (and DATABASES alias) on the module's own server.
OWN = "capped-own"


@pytest.fixture(scope="module")
def own(_databases: None) -> Iterator[PgServer]:
    if pg_bin() is None:
        skip_or_fail("PostgreSQL's server binaries are not installed (apt-get install postgresql)")
    stores = {
        **settings.KEEL_LOCK_STORES,
        OWN: {"BACKEND": "django_keel_lock.stores.DatabaseLockStore", "OPTIONS": {"DATABASE": OWN}},
    }
    with pg_server() as running, override_settings(KEEL_LOCK_STORES=stores):
        connections.settings[OWN] = {**connections.settings["postgres"], **running.settings}
        try:
            call_command("migrate", "django_keel_lock", database=OWN, verbosity=0)
            yield running
        finally:
            get_lock_store(OWN).close()
            connections[OWN].close()
            del connections[OWN]
            del connections.settings[OWN]


def own_connection(server: PgServer) -> Any:
    import psycopg

    return psycopg.connect(
        host="127.0.0.1", port=server.port, user=server.user, dbname="postgres", autocommit=True
    )


def _owner() -> str:
    return uuid.uuid4().hex


def _unconfirmed(key: str, alias: str = OWN) -> int | None:
    return LockRow.objects.using(alias).get(key=key).unconfirmed


def hand_over(
    store: DatabaseLockStore, raw: Any, key: str, ttl: float = 30, waiter_ttl: float = 30
) -> tuple[str, int, float | None]:
    """`key` taken for `ttl` through `store` and released with a waiter (of `waiter_ttl`) in
    line whose place names `raw`, a listener's connection at ADDRESS: (the waiter, the fence
    it was handed, what its grant is good for: None unless capped)."""
    holder, waiter = _owner(), _owner()
    (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
    assert store.acquire(key, holder, "h", ttl).acquired
    assert not store.acquire_queued(key, waiter, "w", waiter_ttl).acquired
    database = store.database
    place = Waiter.objects.using(database).filter(key=key, owner=waiter)
    assert place.update(address=ADDRESS, listener=pid)
    assert store.release(key, holder)
    notes = list(raw.notifies(timeout=1, stop_after=1))
    assert [n.channel for n in notes] == [grant_channel(ADDRESS)]
    granted_key, owner, fence, good_for = read_grant(notes[0].payload)
    assert (granted_key, owner) == (key, waiter)
    return waiter, fence, good_for


def capped_hand_over(
    store: DatabaseLockStore, raw: Any, key: str, ttl: float = 30, waiter_ttl: float = 30
) -> tuple[str, str, int, float]:
    """`hand_over`, again on another key where drawing the fence wrote the sequence's WAL
    record (once in 32 draws; the release then waits for the flush): (the key, the waiter,
    the fence, what the capped grant is good for)."""
    for attempt in range(3):
        name = f"{key}:{attempt}"
        waiter, fence, good_for = hand_over(store, raw, name, ttl, waiter_ttl)
        if good_for is not None:
            return name, waiter, fence, good_for
    raise AssertionError("no release handed the lock over capped")


@pytest.fixture
def raw(own: PgServer) -> Iterator[Any]:
    """A connection to the module's server that listens as a waiting process's listener does,
    at ADDRESS, taking capped grants (`LISTENER_SQL`)."""
    with listening_at(ADDRESS, lambda: own_connection(own)) as listening:
        yield listening


def test_a_durable_release_hands_over_capped_to_a_listening_waiter(raw: Any, key: str) -> None:
    store = get_lock_store(OWN)
    taken, waiter, fence, good_for = capped_hand_over(store, raw, key, ttl=30, waiter_ttl=20)
    info = store.get(taken)
    assert info is not None and (info.owner, info.fence) == (waiter, fence)
    assert 19 < info.expires_in <= 20  # the row: the waiter's whole ttl
    assert 19 < good_for <= 20  # believed: at most its ttl, at most what was left of 30 s
    assert _unconfirmed(taken) == fence
    assert store.extend(taken, waiter, 20)  # the waiter's confirmation
    assert _unconfirmed(taken) is None
    assert store.release(taken, waiter)


def test_good_for_is_what_was_left_of_the_releasers_lease(raw: Any, key: str) -> None:
    store = get_lock_store(OWN)
    taken, waiter, _, good_for = capped_hand_over(store, raw, key, ttl=4, waiter_ttl=6)
    assert 3 < good_for <= 4
    assert store.release(taken, waiter)


def test_a_release_hands_over_flushed_where_capping_is_not_safe(raw: Any, key: str) -> None:
    store = get_lock_store(OWN)
    # Less than half the waiter's ttl left on the releaser's lease: flushed, whole ttl.
    waiter, _, good_for = hand_over(store, raw, f"{key}:short", ttl=4, waiter_ttl=30)
    assert good_for is None and _unconfirmed(f"{key}:short") is None
    assert store.release(f"{key}:short", waiter)
    # A releaser whose own holding is unconfirmed (handed over capped, not extended since):
    # its release waits for the flush, which confirms the next holding.
    chain, first, handed, _ = capped_hand_over(store, raw, f"{key}:chain")
    (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
    second = _owner()
    assert not store.acquire_queued(chain, second, "w", 30).acquired
    assert (
        Waiter.objects.using(OWN)
        .filter(key=chain, owner=second)
        .update(address=ADDRESS, listener=pid)
    )
    assert _unconfirmed(chain) == handed
    assert store.release(chain, first)
    (note,) = raw.notifies(timeout=1, stop_after=1)
    _, owner, _, good_for = read_grant(note.payload)
    assert owner == second and good_for is None
    assert _unconfirmed(chain) is None
    assert store.release(chain, second)


def test_a_listener_that_does_not_take_capped_grants_gets_the_whole_ttl(key: str) -> None:
    # Code from before migration 0011 holds the listener's lock alone: its waiters are
    # handed the lock flushed, with the grant as that code reads it.
    store = database_store_of("postgres")
    with postgres_connection() as raw:
        raw.execute(f"LISTEN {address_channel(ADDRESS)}")
        raw.execute(f"LISTEN {grant_channel(ADDRESS)}")
        raw.execute(f"SELECT pg_advisory_lock({LISTENER_LOCK}, pg_backend_pid())")
        waiter, _, good_for = hand_over(store, raw, key)
        assert good_for is None
        assert _unconfirmed(key, "postgres") is None
        assert store.release(key, waiter)


def test_a_release_that_is_not_durable_marks_its_grant_unconfirmed(raw: Any, key: str) -> None:
    fast = DatabaseLockStore(f"{OWN}-fast", {"DATABASE": OWN, "DURABLE": False})
    try:
        waiter, fence, good_for = hand_over(fast, raw, key)
        assert good_for is None  # not capped: nothing is believed beyond what the store keeps
        assert _unconfirmed(key) == fence  # not on disk: its own release may not cap
        assert fast.release(key, waiter)
    finally:
        fast.close()


@contextmanager
def handed_capped(key: str, **options: Any) -> Iterator[tuple[Lock, str, float]]:
    """A handle (of `options`) that waited in this process and was handed a capped grant,
    with the store's worker threads kept busy, so its confirming extend waits, until the
    block ends: (the handle, its key, when the lock was released to it). The grant goes to
    the waiter straight from the release's reply, with what it is good for."""
    store, pool, busy = get_lock_store(OWN), ThreadPoolExecutor(1), threading.Event()
    blocking = [store.submit(busy.wait, 30) for _ in range(store.worker_threads)]
    try:
        for attempt in range(3):
            name, holder = f"{key}:{attempt}", _owner()
            handle = lock(name, store=OWN, ttl=30, **options)
            assert store.acquire(name, holder, "h", 20).acquired  # half the ttl at least
            took = pool.submit(handle.acquire, timeout=10)
            assert wait_until(lambda name=name: _heard_in_line(store, name), 10), "not in line"
            released = time.monotonic()
            assert store.release(name, holder)
            assert took.result(10)
            if handle.confirmed_until() < released + 20:  # capped: what was left of 20 s
                break
            # Flushed (the WAL was not on disk yet at the fence's draw), or taken up with a
            # call (a refusal read the fence drawn for the grant): another key.
            handle.release()
        else:
            raise AssertionError("no release handed the lock over capped")
        assert _unconfirmed(name) == handle.fence
        yield handle, name, released
    finally:
        busy.set()
        pool.shutdown()
    assert all(done.result(10) for done in blocking)


@pytest.mark.parametrize("auto_extend", [False, True])
def test_a_waiting_handle_handed_a_capped_grant_confirms_it(
    own: PgServer, key: str, auto_extend: bool
) -> None:
    with handed_capped(key, auto_extend=auto_extend) as (handle, name, released):
        pass
    assert wait_until(lambda: _unconfirmed(name) is None, 10), "never confirmed"
    assert wait_until(lambda: handle.confirmed_until() > released + 29, 10)  # the whole ttl
    assert handle.fence == LockRow.objects.using(OWN).get(key=name).fence
    assert handle.release() and not handle.lost


def test_a_capped_grant_the_store_no_longer_has_is_reported_lost(own: PgServer, key: str) -> None:
    # As after a crash that lost the grant: the row is the releaser's again when the
    # confirming extend comes.
    lost: list[Lock] = []
    with handed_capped(key, on_lost=lost.append) as (handle, name, _):
        LockRow.objects.using(OWN).filter(key=name).update(owner=_owner())
    assert wait_until(lambda: handle.lost, 10), "the loss was not noticed"
    assert lost == [handle]
    assert not handle.release()


def test_a_capped_grant_released_before_its_confirmation_is_not_lost(
    own: PgServer, key: str
) -> None:
    with handed_capped(key) as (handle, name, _):
        assert handle.release()  # the confirming extend, still waiting, then finds it gone
    time.sleep(0.3)
    assert not handle.lost
    assert store_row_free(name)


def store_row_free(key: str) -> bool:
    return get_lock_store(OWN).get(key) is None


def _heard_in_line(store: DatabaseLockStore, key: str) -> bool:
    """Whether `key`'s line has a place whose listener's connection holds its locks: this
    process's listener LISTENs for `key` (a release then carries the grant)."""
    listener = store._listener
    places = Waiter.objects.using(OWN).filter(key=key, listener__isnull=False)
    return (
        listener is not None
        and key in getattr(listener, "subscribed", ())
        and not getattr(listener, "parked", True)
        and places.exists()
    )


def test_a_release_with_that_keeps_the_lock_still_confirms_it(own: PgServer, key: str) -> None:
    # An operation that leaves the lock held (an idempotent request with no result yet):
    # the confirmation stopped for it is sent again.
    with handed_capped(key) as (handle, name, released):
        assert handle.release_with(lambda key, owner: None) is None
    assert wait_until(lambda: _unconfirmed(name) is None, 10), "never confirmed"
    assert wait_until(lambda: handle.confirmed_until() > released + 29, 10)
    assert handle.release() and not handle.lost


@pytest.mark.parametrize(
    ("options", "capped"),
    [({}, True), ({"CAPPED_GRANTS": False}, False), ({"DURABLE": False}, False)],
)
def test_a_listener_takes_capped_grants_only_where_its_store_may(
    key: str, options: dict[str, Any], capped: bool
) -> None:
    # A store that is not durable, or says CAPPED_GRANTS: False, holds the listener's lock
    # alone: the waiters of its process are handed the lock flushed.
    store = DatabaseLockStore("pg-capped", {"DATABASE": "postgres", **options})
    try:
        with store.watch(key), postgres_connection() as raw:
            assert wait_until(lambda: _listening(store, key), 10), "the listener never listened"
            pid = store._listener.backend_pid  # type: ignore[union-attr]
            assert (
                holds_advisory(raw, LISTENER_LOCK, pid),
                holds_advisory(raw, CAPPED_LOCK, pid),
            ) == (
                True,
                capped,
            )
    finally:
        store.close()


def _listening(store: DatabaseLockStore, key: str) -> bool:
    listener = store._listener
    return listener is not None and key in listener.subscribed and not listener.parked


def test_a_database_migrated_to_0010_only_hands_over_as_before(key: str) -> None:
    """Code newer than the database (0011 not applied yet, as in a deploy that migrates
    after it starts the new code): extends, hand-offs and releases work, uncapped."""
    with (
        empty_database("postgres", "before-capped"),
        override_settings(
            KEEL_LOCK_STORES={
                "before-capped": {
                    "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
                    "OPTIONS": {"DATABASE": "before-capped"},
                }
            }
        ),
    ):
        call_command("migrate", "django_keel_lock", "0010", database="before-capped", verbosity=0)
        store = get_lock_store("before-capped")
        try:
            holder = lock(key, ttl=30, store="before-capped")
            assert holder.acquire()
            holder.extend(30)  # raises if the store refuses it
            waiter = lock(key, ttl=30, store="before-capped", auto_extend=True)
            with ThreadPoolExecutor(1) as pool, postgres_connection() as raw:
                took = pool.submit(waiter.acquire, timeout=10)
                assert wait_until(lambda: _listening(store, key), 10), "nobody listens"
                # Its releases read no `good_for`: its listener takes no capped grant.
                pid = store._listener.backend_pid  # type: ignore[attr-defined]
                assert holds_advisory(raw, LISTENER_LOCK, pid)
                assert not holds_advisory(raw, CAPPED_LOCK, pid)
                assert holder.release()
                assert took.result(10)
            waiter.extend(30)
            assert waiter.release()
        finally:
            store.close()
