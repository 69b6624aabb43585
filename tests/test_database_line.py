"""The line of waiters of the database store (PostgreSQL, MariaDB; see `database.line`): a
release wakes only the first of them, places lapse and are cleaned up, the uncontended attempt
costs what a plain acquire does, and a database without the table keeps no line. The order,
leaving and dying are tests/test_line.py's, for every store with a line."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_keel_lock import get_lock_store, lock
from django_keel_lock.models import Lock, Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.base import QUEUE_LEASE, AcquireResult
from django_keel_lock.stores.database import store as database_store
from django_keel_lock.stores.database.dialects.postgresql import (
    LISTENER_SQL,
    address_channel,
    grant_channel,
    read_grant,
)

from .conftest import database_of, empty_database
from .test_database_edges import waiting_flag
from .test_database_faults import wait_until
from .test_database_wakeups import statements_of as mariadb_statements_of

FORK = multiprocessing.get_context("fork")


def database_store_of(alias: str) -> DatabaseLockStore:
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    return store


def in_line(alias: str, key: str) -> int:
    """How many live places `key`'s line has (the database's clock is this machine's)."""
    places = Waiter.objects.using(database_of(alias)).filter(key=key)
    return places.filter(expires_at__gt=timezone.now()).count()


def _wait_in_line(
    alias: str, key: str, out: str, timeout: float, retry_delay: float, hold: float
) -> None:
    """In a child: wait for `key`, hold it `hold` seconds, release; write what happened to
    `out`, with the monotonic time of each attempt (the clock is the machine's, shared by
    every process)."""
    store = database_store_of(alias)
    attempts: list[float] = []
    ask = store.acquire_queued

    def counted(*args: Any) -> Any:
        attempts.append(time.monotonic())
        return ask(*args)

    store.acquire_queued = counted  # type: ignore[method-assign]
    handle = lock(key, ttl=30, store=alias)
    acquired = handle.acquire(timeout=timeout, retry_delay=retry_delay)
    got, fence, released = time.monotonic(), handle.fence, None
    if acquired:
        time.sleep(hold)
        released = time.monotonic()
        assert handle.release()
    report = {"acquired": acquired, "fence": fence, "got": got, "released": released}
    Path(out).write_text(json.dumps({**report, "attempts": attempts}))


@contextmanager
def waiters_in_line(
    alias: str,
    key: str,
    tmp_path: Path,
    count: int,
    hold: float = 0.3,
    timeouts: tuple[float, ...] = (),
) -> Iterator[tuple[list[Any], Callable[[], list[dict[str, Any]]]]]:
    """`count` child processes waiting for `key` (held by the caller; retry_delay 5 s, the
    i-th for timeouts[i] s, else 20), each started only once the one before stands in the
    line; yields the processes and a reader of their reports (after they end)."""
    outs = [tmp_path / f"waiter-{i}.json" for i in range(count)]
    procs = []
    try:
        for i, out in enumerate(outs):
            timeout = timeouts[i] if i < len(timeouts) else 20.0
            proc = FORK.Process(
                target=_wait_in_line, args=(alias, key, str(out), timeout, 5.0, hold)
            )
            proc.start()
            procs.append(proc)
            assert wait_until(lambda i=i: in_line(alias, key) == i + 1, 10), "not in line"

        def reports() -> list[dict[str, Any]]:
            for proc in procs:
                proc.join(30)
            return [json.loads(out.read_text()) if out.exists() else {} for out in outs]

        yield procs, reports
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def test_a_release_wakes_only_the_first_waiter_in_line(
    server_alias: str, key: str, tmp_path: Path
) -> None:
    """Each release (the holder's, then each waiter's) must bring the next in line an attempt
    at once, and nobody else: waiters behind it ask only on their own schedule (at least
    every QUEUE_LEASE / 2 s to keep their place), so at most a stray one of those may fall
    into the 50 ms after a release by chance. Were every waiter woken, all would."""
    holder = lock(key, ttl=30, store=server_alias)
    assert holder.acquire()
    with waiters_in_line(server_alias, key, tmp_path, 3, hold=0.6) as (_, reports):
        time.sleep(0.3)
        released = time.monotonic()
        assert holder.release()
        found = reports()
    assert [report["acquired"] for report in found] == [True, True, True]
    releases = [released, found[0]["released"], found[1]["released"]]
    woken = 0
    for i, at in enumerate(releases):
        # The next in line took the lock at once: it was woken.
        assert found[i]["got"] - at < 0.3, (i, found[i]["got"] - at)
        # Those behind it did not ask within 50 ms of the release.
        woken += sum(
            any(at <= attempt < at + 0.05 for attempt in report["attempts"])
            for report in found[i + 1 :]
        )
    assert woken <= 1, woken


def test_a_waiter_is_refused_a_free_lock_while_another_is_first(
    server_alias: str, key: str
) -> None:
    store = database_store_of(server_alias)
    assert store.queues
    assert store.acquire(key, "holder", "h", 30).acquired
    first = store.acquire_queued(key, "first", "f", 30)
    second = store.acquire_queued(key, "second", "s", 30)
    assert not first.acquired and not second.acquired
    assert 0 < (first.retry_in or 0) <= QUEUE_LEASE
    assert store.release(key, "holder")
    # Free, but "first" is first: "second" waits (at most the first's lease), and a plain
    # acquire (no wait: it may barge in) is not asked to.
    refused = store.acquire_queued(key, "second", "s", 30)
    assert not refused.acquired and 0 < (refused.retry_in or 0) <= QUEUE_LEASE
    taken = store.acquire_queued(key, "first", "f", 30)
    assert taken.acquired
    assert store.release(key, "first")
    store.leave_queue(key, "second")
    assert in_line(server_alias, key) == 0
    barging = store.acquire(key, "plain", "p", 30)
    assert barging.fence is not None and barging.fence > (taken.fence or 0)
    assert store.release(key, "plain")


def test_a_waiter_whose_place_lapsed_goes_to_the_end_of_the_line(
    server_alias: str, key: str
) -> None:
    store = database_store_of(server_alias)
    assert store.acquire(key, "holder", "h", 30).acquired
    assert not store.acquire_queued(key, "late", "l", 30).acquired
    assert not store.acquire_queued(key, "next", "n", 30).acquired
    expire_places(server_alias, key, owner="late")
    assert not store.acquire_queued(key, "late", "l", 30).acquired  # at the end now
    assert store.release(key, "holder")
    assert not store.acquire_queued(key, "late", "l", 30).acquired
    assert store.acquire_queued(key, "next", "n", 30).acquired
    assert store.release(key, "next")
    assert store.acquire_queued(key, "late", "l", 30).acquired
    assert store.release(key, "late")


def expire_places(alias: str, key: str, owner: str | None = None) -> None:
    """Make `key`'s places in line (or `owner`'s) lapse: expired an hour ago."""
    places = Waiter.objects.using(database_of(alias)).filter(key=key)
    if owner is not None:
        places = places.filter(owner=owner)
    lapsed = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
    assert places.update(expires_at=lapsed)


def test_the_clean_up_deletes_lapsed_places_and_keeps_live_ones(
    server_alias: str, key: str
) -> None:
    store = database_store_of(server_alias)
    assert store.acquire(key, "holder", "h", 30).acquired
    for owner in ("dead", "alive"):
        assert not store.acquire_queued(key, owner, owner, 30).acquired
    expire_places(server_alias, key, owner="dead")
    assert store._sweep(database_store._Sweeps()) >= 1
    owners = Waiter.objects.using(database_of(server_alias)).filter(key=key)
    assert list(owners.values_list("owner", flat=True)) == ["alive"]
    expire_places(server_alias, key)
    store.prune()
    assert not owners.exists()
    assert store.release(key, "holder")


def postgres_statements_of(store: DatabaseLockStore, call: Callable[[], object]) -> int:
    """How many statements `call` sends on this thread's connection of `store`: those by
    libpq and those by the cursor (the two ways a statement leaves)."""
    conn, _ = store._connection()
    assert conn.libpq is not None, "the libpq path is what a plain acquire takes"
    sent: list[str] = []
    libpq, cursor = conn.libpq, conn.cursor

    class Counting:
        def __init__(self, inner: Any, *methods: str) -> None:
            self.inner, self.methods = inner, methods

        def __getattr__(self, name: str) -> Any:
            attribute = getattr(self.inner, name)
            if name not in self.methods:
                return attribute

            def counted(statements: Any, *args: Any, **kwargs: Any) -> Any:
                if name == "execute" and self.inner is libpq:
                    sent.extend(sql for sql, _ in statements)
                else:  # the cursor's execute, libpq's `one`: a statement's text
                    sent.append(statements)
                return attribute(statements, *args, **kwargs)

            return counted

    conn.libpq, conn.cursor = Counting(libpq, "execute", "one"), Counting(cursor, "execute")  # type: ignore[assignment]
    try:
        call()
    finally:
        conn.libpq, conn.cursor = libpq, cursor
    return len(sent)


def test_uncontended_waiting_attempt_costs_what_a_plain_acquire_does(
    server_alias: str, key: str
) -> None:
    store = database_store_of(server_alias)
    count = postgres_statements_of if server_alias == "postgres" else mariadb_statements_of
    plain = count(store, lambda: store.acquire(key, "a", "a", 30))
    assert store.release(key, "a")
    queued = count(store, lambda: store.acquire_queued(key, "b", "b", 30))
    assert store.get(key) is not None
    assert queued == plain == (1 if server_alias == "postgres" else 2)
    assert store.release(key, "b")


def postgres_connection() -> Any:
    """A psycopg connection of the test's own to the PostgreSQL test database."""
    import psycopg

    settings = connections["postgres"].settings_dict
    return psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"],
        dbname=settings["NAME"], autocommit=True,
    )  # fmt: skip


@contextmanager
def listening_at(address: str, connect: Callable[[], Any] | None = None) -> Iterator[Any]:
    """A PostgreSQL connection of the test's own (`connect()`'s; default: to the test
    database) that LISTENs on the channels of the wake address `address` (read its
    `notifies()`), holding the locks a listener holds while it listens (`LISTENER_SQL`)."""
    with (connect or postgres_connection)() as raw:
        raw.execute(f"LISTEN {address_channel(address)}")
        raw.execute(f"LISTEN {grant_channel(address)}")
        raw.execute(LISTENER_SQL)
        yield raw


def test_first_in_line_takes_the_freed_lock_in_one_statement(server_alias: str, key: str) -> None:
    store = database_store_of(server_alias)
    database = database_of(server_alias)
    count = postgres_statements_of if server_alias == "postgres" else mariadb_statements_of
    assert store.acquire(key, "holder", "h", 30).acquired
    assert not store.acquire_queued(key, "first", "f", 30).acquired
    assert not store.acquire_queued(key, "second", "s", 30).acquired
    assert store.release(key, "holder")
    # The second is not first: no take, the transaction keeps its place.
    assert not store.acquire_queued(key, "second", "s", 30).acquired
    taken: list[AcquireResult] = []
    sent = count(store, lambda: taken.append(store.acquire_queued(key, "first", "f", 30)))
    info = store.get(key)
    assert info is not None and info.owner == "first" and info.holder == "f"
    assert taken[0].fence == info.fence and 29 < info.expires_in <= 30
    assert sent == 1
    # Its place went with the take (MariaDB: lapsed); the flag stays raised, as the second
    # still waits.
    live = Waiter.objects.using(database).filter(key=key, expires_at__gt=timezone.now())
    assert list(live.values_list("owner", flat=True)) == ["second"]
    assert waiting_flag(database, key)
    # The next to join deletes a lapsed place.
    assert not store.acquire_queued(key, "third", "t", 30).acquired
    places = Waiter.objects.using(database).filter(key=key).order_by("id")
    assert list(places.values_list("owner", flat=True)) == ["second", "third"]
    store.leave_queue(key, "third")
    assert store.release(key, "first")
    second = store.acquire_queued(key, "second", "s", 30)
    assert (second.fence or 0) > (taken[0].fence or 0)
    assert in_line(server_alias, key) == 0
    # Nobody waits any more. MariaDB's take saw that; PostgreSQL's keeps the flag raised (it
    # cannot see who joined while it waited for the row), and the next take lowers it.
    assert waiting_flag(database, key) == (server_alias == "postgres")
    assert store.release(key, "second")
    assert store.acquire_queued(key, "next", "n", 30).acquired
    assert not waiting_flag(database, key)
    assert store.release(key, "next")


def test_a_take_by_the_first_in_line_keeps_the_flag_for_a_waiter_that_joined_meanwhile(
    server_alias: str, key: str
) -> None:
    """The first in line's one-statement take waits for the lock row while another waiter's
    transaction holds it and joins the line: the flag must stay raised, or the next release
    would not wake that waiter, and plain takes would pass it by until its next attempt."""
    store = database_store_of(server_alias)
    database = database_of(server_alias)
    assert store.acquire(key, "holder", "h", 30).acquired
    assert not store.acquire_queued(key, "first", "f", 30).acquired
    assert store.release(key, "holder")
    taken: list[AcquireResult] = []
    with transaction.atomic(using=database):
        Lock.objects.using(database).select_for_update().get(key=key)
        Waiter.objects.using(database).create(
            key=key, owner="joined", address="",
            expires_at=timezone.now() + datetime.timedelta(seconds=QUEUE_LEASE),
        )  # fmt: skip
        thread = threading.Thread(
            target=lambda: taken.append(store.acquire_queued(key, "first", "f", 30))
        )
        thread.start()
        assert wait_until(lambda: waits_for_me(database, key), 10)
    thread.join(10)
    assert taken and taken[0].acquired
    assert waiting_flag(database, key)
    assert store.release(key, "first")
    Waiter.objects.using(database).filter(key=key).delete()


def waits_for_me(database: str, key: str) -> bool:
    """Whether another connection's statement on `key` waits for a lock this thread's
    connection to `database` holds (MariaDB: the statement is running still; a multi-table
    UPDATE waits for the row while it is being planned, where InnoDB's lock views miss it)."""
    with connections[database].cursor() as cursor:
        if connections[database].vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted "
                "AND pg_backend_pid() = ANY(pg_blocking_pids(pid))"
            )
        else:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE ID <> CONNECTION_ID() AND INFO LIKE %s",
                [f"%{key}%"],
            )
        return bool(cursor.fetchone()[0])


def test_a_waiter_joining_the_line_deletes_the_places_that_lapsed(
    server_alias: str, key: str
) -> None:
    """Not only at the clean-up's next round: the line's reads would step over them."""
    store = database_store_of(server_alias)
    database = database_of(server_alias)
    places = Waiter.objects.using(database).filter(key=key).order_by("id")
    assert store.acquire(key, "holder", "h", 30).acquired
    for owner in ("gone", "stays", "mine"):
        assert not store.acquire_queued(key, owner, owner, 30).acquired
    past = timezone.now() - datetime.timedelta(seconds=1)
    assert places.filter(owner__in=["gone", "mine"]).update(expires_at=past) == 2
    # "mine" asks again: "gone" is deleted, and its own lapsed place goes to the end.
    assert not store.acquire_queued(key, "mine", "m", 30).acquired
    assert list(places.values_list("owner", flat=True)) == ["stays", "mine"]
    assert places.get(owner="mine").expires_at > timezone.now()
    for owner in ("stays", "mine"):
        store.leave_queue(key, owner)
    assert store.release(key, "holder")


def test_postgres_release_notifies_the_first_waiters_process_alone_while_the_line_has_one(
    key: str, postgres_notifications: Callable[[str], Callable[[], int]]
) -> None:
    """The key's channel (every process waiting for it) hears nothing while the line has a
    first waiter with an address; that address's channel hears the key (the lock handed over
    to that waiter). With the line empty again, releases NOTIFY the key's channel as before
    lines (permit waiters listen there)."""
    store = database_store_of("postgres")
    on_key = postgres_notifications(key)
    with listening_at("feedface") as raw:
        assert store.acquire(key, "a", "a", 30).acquired
        assert not store.acquire_queued(key, "w", "w", 30).acquired
        place = Waiter.objects.using("postgres").filter(key=key)
        assert place.update(address="feedface", listener=None)  # it listens nowhere known
        assert postgres_statements_of(store, lambda: store.release(key, "a")) == 1
        assert [n.payload for n in raw.notifies(timeout=0.3)] == [key]
        assert on_key() == 0
        handed = store.get(key)
        assert handed is not None and handed.owner == "w"
        store.leave_queue(key, "w")  # passed on: to nobody, so the key's channel hears it
        assert on_key() == 1
        assert store.acquire(key, "a", "a", 30).acquired
        assert not store.acquire(key, "b", "b", 30).acquired  # raises the flag
        assert store.release(key, "a")
        assert on_key() == 1
        assert list(raw.notifies(timeout=0.3)) == []


def test_postgres_leaving_the_line_with_a_grant_passes_it_to_the_next_and_wakes_it(
    key: str,
) -> None:
    store = database_store_of("postgres")
    with listening_at("beef") as raw:
        assert store.acquire(key, "holder", "h", 30).acquired
        for owner, address in (("first", "dead"), ("next", "beef")):
            assert not store.acquire_queued(key, owner, owner, 30).acquired
            places = Waiter.objects.using("postgres").filter(key=key, owner=owner)
            assert places.update(address=address, listener=None)
        assert store.release(key, "holder")  # hands over to "first" (at a deaf address)
        assert list(raw.notifies(timeout=0.3)) == []
        store.leave_queue(key, "first")  # its grant goes on: "next" is first now
        assert [n.payload for n in raw.notifies(timeout=0.3)] == [key]
        handed = store.get(key)
        assert handed is not None and handed.owner == "next"
        store.leave_queue(key, "next")
        assert list(raw.notifies(timeout=0.3)) == []
        assert store.get(key) is None


def _backend_there(pid: int) -> bool:
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return bool(cursor.fetchone()[0])


def test_postgres_release_carries_the_grant_at_the_whole_ttl_while_the_listener_is_there(
    key: str,
) -> None:
    store = database_store_of("postgres")
    with listening_at("feedface") as raw:
        (pid,) = raw.execute("SELECT pg_backend_pid()").fetchone()
        assert store.acquire(key, "a", "a", 30).acquired
        refused = store.acquire_queued(key, "w" * 32, "w", 30)
        assert refused.last_fence is not None
        place = Waiter.objects.using("postgres").filter(key=key)
        assert place.update(address="feedface", listener=pid)
        assert store.release(key, "a")
        granted = store.get(key)
        assert granted is not None and granted.owner == "w" * 32
        assert granted.fence > refused.last_fence
        assert granted.expires_in > QUEUE_LEASE  # its whole ttl: it makes no call
        notes = list(raw.notifies(timeout=0.3))
        assert [n.channel for n in notes] == [grant_channel("feedface")]
        carried = read_grant(notes[0].payload)
        assert carried[:3] == (key, "w" * 32, granted.fence)
        # Capped (a's lease had ~30 s left, on disk): believed that long, until confirmed;
        # or, where drawing the fence wrote the sequence's WAL record, made on disk first.
        assert carried[3] is None or 29 < carried[3] <= 30
    # Its listener gone, the next grant is for what is left of the place, and a wake-up.
    assert wait_until(lambda: not _backend_there(pid), 10)
    assert not store.acquire_queued(key, "v" * 32, "v", 30).acquired
    assert Waiter.objects.using("postgres").filter(key=key, owner="v" * 32).update(listener=pid)
    assert store.release(key, "w" * 32)
    handed = store.get(key)
    assert handed is not None and handed.owner == "v" * 32
    assert handed.expires_in <= QUEUE_LEASE
    store.leave_queue(key, "v" * 32)
    assert store.get(key) is None


def test_postgres_release_carries_no_grant_to_a_backend_that_does_not_listen_for_it(
    key: str,
) -> None:
    # The waiter's place names its listener's backend pid; a connection that is there under
    # that pid but is no listener (the pid reused after the listener went) carries nothing:
    # the grant is for what is left of the place, with a wake-up, and no NOTIFY is sent on
    # a grant channel nobody may hear.
    store = database_store_of("postgres")
    with listening_at("feedface") as raw:
        other = postgres_connection()
        (pid,) = other.execute("SELECT pg_backend_pid()").fetchone()
        assert store.acquire(key, "a", "a", 30).acquired
        assert not store.acquire_queued(key, "w" * 32, "w", 30).acquired
        place = Waiter.objects.using("postgres").filter(key=key)
        assert place.update(address="feedface", listener=pid)
        assert store.release(key, "a")
        other.close()
        granted = store.get(key)
        assert granted is not None and granted.owner == "w" * 32
        assert granted.expires_in <= QUEUE_LEASE  # what is left of its place: it must call
        notes = list(raw.notifies(timeout=0.3))
        assert [(n.channel, n.payload) for n in notes] == [(address_channel("feedface"), key)]
    store.leave_queue(key, "w" * 32)
    assert store.get(key) is None


def test_postgres_leaving_the_line_of_a_free_lock_wakes_the_next_in_it(key: str) -> None:
    # A place without a ttl (written before hand-offs) is woken, not handed the lock: the
    # lock stays free, and when it leaves, the next is woken to take it.
    store = database_store_of("postgres")
    with listening_at("beef") as raw:
        assert store.acquire(key, "holder", "h", 30).acquired
        for owner, address in (("first", "dead"), ("next", "beef")):
            assert not store.acquire_queued(key, owner, owner, 30).acquired
            places = Waiter.objects.using("postgres").filter(key=key, owner=owner)
            assert places.update(address=address, ttl=None, listener=None)
        assert store.release(key, "holder")  # wakes "first" (at an address nobody hears)
        assert store.get(key) is None
        assert list(raw.notifies(timeout=0.3)) == []
        store.leave_queue(key, "first")  # the lock is free: "next" is first now
        assert [n.payload for n in raw.notifies(timeout=0.3)] == [key]
        store.leave_queue(key, "next")
        assert list(raw.notifies(timeout=0.3)) == []


def test_sqlite_keeps_no_line(key: str) -> None:
    store = database_store_of("sqlite")
    assert not store.queues
    with pytest.raises(NotImplementedError):
        store.acquire_queued(key, "a", "a", 30)


def test_waiter_rows_exist_on_every_database(db_alias: str) -> None:
    database = database_of(db_alias)
    with connections[database].cursor() as cursor:
        assert "django_keel_lock_waiter" in connections[database].introspection.table_names(cursor)


@pytest.mark.parametrize("migrated_to", ["0004", "0008"])
def test_a_database_without_the_line_table_keeps_no_line_and_its_locks_work(
    server_alias: str, migrated_to: str
) -> None:
    """Code newer than the database's migrations (0005, or 0009 with the hand-off's columns,
    not applied yet, as in a deploy that migrates after it starts the new code): waits and
    releases go on as before lines."""
    with (
        empty_database(database_of(server_alias), "before-lines"),
        override_settings(
            KEEL_LOCK_STORES={
                "before-lines": {
                    "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
                    "OPTIONS": {"DATABASE": "before-lines"},
                }
            }
        ),
    ):
        call_command(
            "migrate", "django_keel_lock", migrated_to, database="before-lines", verbosity=0
        )
        store = database_store_of("before-lines")
        try:
            holder = lock("line:old", ttl=30, store="before-lines")
            assert holder.acquire()
            assert not store.queues
            waiter = lock("line:old", ttl=30, store="before-lines")
            assert not waiter.acquire(timeout=0.3, retry_delay=0.05)
            assert holder.release()
            assert waiter.acquire(timeout=2) and waiter.release()
        finally:
            store.close()
