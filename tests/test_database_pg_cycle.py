"""The PostgreSQL uncontended cycle's short cuts under contention, with real connections held
at a point: the release whose WITH frees a lock nobody waits for (migration 0009's function
runs only where it freed nothing), and the retake of the lock a thread freed last (a plain
UPDATE, then the upsert)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.models import Lock, Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.line import Line

from .conftest import database_like, needs_store, serving
from .support.redis_servers import FaultyProxy
from .support.threads import call_in_thread
from .test_database_faults import timed, wait_until
from .test_database_line import database_store_of
from .test_database_store import _RETAKE, _UPSERT, _runs

pytestmark = needs_store("postgres")


@contextmanager
def _connection(autocommit: bool = False) -> Iterator[Any]:
    """A PostgreSQL connection of the test's own to the stores' database."""
    import psycopg

    settings = connections["postgres"].settings_dict
    with psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"],
        dbname=settings["NAME"], autocommit=autocommit,
    ) as raw:  # fmt: skip
        yield raw


def _waits_for_a_row(monitor: Any, text: str) -> bool:
    """Whether a statement whose text has `text` waits for a lock (a row's) now."""
    (count,) = monitor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE %s AND pid <> pg_backend_pid()",
        (f"%{text}%",),
    ).fetchone()
    return bool(count)


def test_postgres_waiter_that_raises_the_flag_while_the_release_waits_is_handed_the_lock(
    key: str,
) -> None:
    """A waiter that joins the line while a release of the lock waits for its row (the
    waiter's transaction locked it first; the release's snapshot saw the flag down) is
    handed the lock: the release's own UPDATE rechecks the row's new version, finds the flag
    raised and frees nothing, and the hand-off function reads the line afresh. Freed by that
    UPDATE instead, the lock would be free with the waiter in line and nobody woken."""
    store = database_store_of("postgres")
    first = store.acquire(key, "holder", "h", 30).fence
    assert first is not None
    with _connection() as waiter, _connection(autocommit=True) as monitor:
        # The waiter's attempt in the line, by the store's own code, on a transaction held
        # open: the row locked, the place taken, the flag raised, not committed yet.
        result, queued = Line(store.dialect, waiter.cursor()).acquire(
            key, "waiter", "w", 30, "", None
        )
        assert queued and not result.acquired
        thread, released = call_in_thread(store, lambda: store.release(key, "holder"))
        try:
            assert wait_until(lambda: _waits_for_a_row(monitor, "WITH freed"), 10)
        finally:
            waiter.commit()
            thread.join(10)
    assert released == [True]
    row = Lock.objects.using("postgres").get(key=key)
    assert (row.owner, row.holder) == ("waiter", "w"), "the waiter was not handed the lock"
    assert row.fence > first
    assert Waiter.objects.using("postgres").get(key=key, owner="waiter").fence == row.fence


def test_postgres_waiter_whose_attempt_waits_behind_a_release_that_frees_takes_the_lock(
    key: str,
) -> None:
    """The other order: a release that frees the lock nobody waits for (its WITH's UPDATE)
    gets the row first, and a waiter's attempt, which came while the release waited for the
    row, waits for it in turn: that attempt then reads the row freed, and takes it. (A third
    connection holds the row to line them up, and changes nothing in it.)"""
    store = database_store_of("postgres")
    first = store.acquire(key, "holder", "h", 30).fence
    assert first is not None
    with _connection() as blocker, _connection(autocommit=True) as monitor:
        blocker.execute("SELECT 1 FROM django_keel_lock_lock WHERE key = %s FOR UPDATE", (key,))
        releasing, released = call_in_thread(store, lambda: store.release(key, "holder"))
        waiting, taken = None, []
        try:
            assert wait_until(lambda: _waits_for_a_row(monitor, "WITH freed"), 10)
            waiting, taken = call_in_thread(
                store, lambda: store.acquire_queued(key, "waiter", "w", 30)
            )
            assert wait_until(lambda: _waits_for_a_row(monitor, "ON CONFLICT"), 10)
        finally:
            blocker.commit()
            releasing.join(10)
            if waiting is not None:
                waiting.join(10)
    assert released == [True]
    assert len(taken) == 1 and taken[0].acquired and taken[0].fence > first, taken
    row = Lock.objects.using("postgres").get(key=key)
    assert (row.owner, row.fence) == ("waiter", taken[0].fence)
    assert store.release(key, "waiter")


class _SlowReplies(FaultyProxy):
    """A FaultyProxy that holds the first part of each reply `delay` seconds (0: none): a
    server that answers every statement late, the same each time."""

    delay = 0.0

    def _pump(self, source: socket.socket, sink: socket.socket, reply: bool) -> None:
        super()._pump(source, _Late(sink, self) if reply else sink, reply)


class _Late:
    """The client's side of a proxied connection, whose sendall() waits the proxy's delay
    before the first part of each reply (a reply follows a request: `trips` moved)."""

    def __init__(self, sock: socket.socket, proxy: _SlowReplies) -> None:
        self.sock, self.proxy, self.trips = sock, proxy, -1

    def sendall(self, data: bytes) -> None:
        if self.trips != self.proxy.trips:
            self.trips = self.proxy.trips
            time.sleep(self.proxy.delay)
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@contextmanager
def _through_slow_replies(**options: Any) -> Iterator[tuple[DatabaseLockStore, _SlowReplies]]:
    """A store on the `postgres` database reached through a `_SlowReplies` proxy (no pooler
    unless `options` say so)."""
    proxy = _SlowReplies(int(connections.settings["postgres"]["PORT"]))
    name = f"postgres-slow-{uuid.uuid4().hex[:8]}"
    try:
        with database_like("postgres", name, HOST="127.0.0.1", PORT=proxy.port) as through:
            store = DatabaseLockStore(
                name, {"DATABASE": through, "TRANSACTION_POOLER": False, **options}
            )
            with serving(store):
                yield store, proxy
    finally:
        proxy.close()


@pytest.mark.parametrize("pooler", [False, True], ids=["own-sessions", "pooler"])
def test_postgres_retake_and_its_upsert_wait_at_most_socket_timeout_together(
    key: str, pooler: bool
) -> None:
    """An acquire that tries the retake first, then the upsert (the lock taken by another
    since this thread freed it), is one call: it waits for the server at most SOCKET_TIMEOUT
    in all, as any call does (docs/stores.md). Here each reply comes 0.8 s late, at
    SOCKET_TIMEOUT 1 s: the call gives up (LockStoreUnavailable) after 1 s, not refused
    after the two statements' 1.6 s."""
    other = database_store_of("postgres")
    with _through_slow_replies(SOCKET_TIMEOUT=1, TRANSACTION_POOLER=pooler) as (store, proxy):
        for _ in range(2):  # each statement prepared (else a first run is two round trips)
            assert store.acquire(key, "a", "a", 30).acquired
            assert store.release(key, "a")  # this thread's last free release: a retake next
        assert other.acquire(key, "b", "b", 30).acquired
        proxy.delay = 0.8
        result, took = timed(lambda: store.acquire(key, "a", "a", 30))
        proxy.delay = 0.0
        assert isinstance(result, LockStoreUnavailable), f"{result!r} after {took:.2f}s"
        assert took < 1.4, f"the acquire took {took:.2f}s"
    assert other.release(key, "b")


def test_postgres_retake_after_another_took_and_released_draws_a_greater_fence(key: str) -> None:
    """The row a thread freed last, taken and freed by another store since (it is free
    again): the retake takes it by its UPDATE, with a fence greater than the other's, and
    the other's retake, next, greater again."""
    ours = DatabaseLockStore("retake-fence-ours", {"DATABASE": "postgres"})
    theirs = DatabaseLockStore("retake-fence-theirs", {"DATABASE": "postgres"})
    try:
        assert ours.acquire(key, "a", "a", 30).acquired and ours.release(key, "a")
        taken = theirs.acquire(key, "b", "b", 30).fence
        assert taken is not None and theirs.release(key, "b")
        retakes = _runs(ours, _RETAKE)
        upserts = _runs(ours, _UPSERT)
        again = ours.acquire(key, "a", "a", 30).fence
        assert again is not None and again > taken
        assert (_runs(ours, _RETAKE), _runs(ours, _UPSERT)) == (retakes + 1, upserts)
        assert ours.release(key, "a")
        last = theirs.acquire(key, "b", "b", 30).fence
        assert last is not None and last > again and theirs.release(key, "b")
    finally:
        ours.close()
        theirs.close()


_WITH, _ALONE = "WITH freed AS", "FROM django_keel_lock_release($1, $2, NULL,"


def test_postgres_release_of_a_key_handed_over_last_calls_the_function_alone(key: str) -> None:
    """A release of a key whose last release by the store handed the lock over calls the
    release function alone (no WITH first: someone most likely waits again), and still hands
    over; one that then finds nobody waiting frees the lock all the same, and the release
    after it goes back to the WITH."""
    ours = DatabaseLockStore("alone-ours", {"DATABASE": "postgres"})
    theirs = DatabaseLockStore("alone-theirs", {"DATABASE": "postgres"})

    def handed_to(waiter: str) -> None:
        assert ours.acquire(key, "a", "a", 30).acquired
        queued = theirs.acquire_queued(key, waiter, waiter, 30)
        assert not queued.acquired
        assert ours.release(key, "a")
        assert Lock.objects.using("postgres").get(key=key).owner == waiter
        assert theirs.acquire_queued(key, waiter, waiter, 30).acquired  # the grant taken up
        assert theirs.release(key, waiter)

    try:
        handed_to("w1")  # by the WITH, which finds the flag up
        runs = _runs(ours, _WITH), _runs(ours, _ALONE)
        handed_to("w2")  # by the function alone
        assert (_runs(ours, _WITH), _runs(ours, _ALONE)) == (runs[0], runs[1] + 1)
        assert ours.acquire(key, "a", "a", 30).acquired
        assert ours.release(key, "a")  # nobody waits: the function alone frees it
        assert (_runs(ours, _WITH), _runs(ours, _ALONE)) == (runs[0], runs[1] + 2)
        assert theirs.acquire(key, "b", "b", 30).acquired and theirs.release(key, "b")
        assert ours.acquire(key, "a", "a", 30).acquired
        assert ours.release(key, "a")  # by the WITH again
        assert (_runs(ours, _WITH), _runs(ours, _ALONE)) == (runs[0] + 1, runs[1] + 2)
        assert not ours.release(key, "a")
    finally:
        ours.close()
        theirs.close()
