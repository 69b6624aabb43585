"""What only the database store must get right about permits: its round trips, its NOTIFYs, the
caller's transaction, and the permit slots a key keeps (those of an expired gate too)."""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.contrib.auth.models import Group
from django.db import connections, transaction

from django_keel_lock import get_lock_store
from django_keel_lock.models import Permit
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.base import EXCLUSIVE, SHARED, semaphore_mode

from .conftest import DATABASE_STORES, database_like, database_of, needs_store, store_params

THREE = semaphore_mode(3)


def owner() -> str:
    return secrets.token_hex(16)


@pytest.fixture(params=store_params(DATABASE_STORES))
def db_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def permit_rows(alias: str, key: str) -> int:
    return Permit.objects.using(database_of(alias)).filter(key=key).count()


@contextmanager
def round_trips(store: DatabaseLockStore) -> Iterator[Callable[[], int]]:
    """Count the requests this thread's connection of `store` sends the server while the block
    runs, from libpq's own trace of the wire protocol: each Sync (one extended-protocol
    exchange: parse/bind/execute) or simple Query is a round trip."""
    conn, _ = store._connection()
    pgconn = conn.wrapper.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        counted: list[int] = []
        try:
            yield lambda: counted[0]
        finally:
            pgconn.untrace()
            trace.flush()
            os.lseek(trace.fileno(), 0, os.SEEK_SET)
            sent = [line.split("\t") for line in trace.read().splitlines()]
            counted.append(
                sum(1 for f in sent if len(f) > 3 and f[1] == "F" and f[3] in {"Sync", "Query"})
            )


@needs_store("postgres")
def test_postgres_permit_acquire_and_release_are_one_round_trip_each(key: str) -> None:
    store = DatabaseLockStore("traced", {"DATABASE": "postgres"})
    try:
        warm = owner()  # the first call of each statement prepares it: another exchange
        assert store.acquire_permit(key, warm, "h", 30, THREE).acquired
        assert store.release_permit(key, warm)
        a, b = owner(), owner()
        with round_trips(store) as acquire_trips:
            assert store.acquire_permit(key, a, "a", 30, THREE).acquired
        with round_trips(store) as second_trips:
            assert store.acquire_permit(key, b, "b", 30, THREE).acquired
        with round_trips(store) as release_trips:
            assert store.release_permit(key, a)
        with round_trips(store) as last_release_trips:
            assert store.release_permit(key, b)
        assert (acquire_trips(), second_trips()) == (1, 1)
        assert (release_trips(), last_release_trips()) == (1, 1)
        assert store.holders(key) == []
    finally:
        store.close()


@needs_store("postgres")
@pytest.mark.django_db(databases="__all__", transaction=True)
def test_postgres_permit_release_notifies_when_someone_was_refused(
    key: str, postgres_notifications: Callable[[str], Callable[[], int]]
) -> None:
    store = get_lock_store("postgres")
    notifies = postgres_notifications(key)
    one = semaphore_mode(1)
    a, b = owner(), owner()
    assert store.acquire_permit(key, a, "a", 30, one).acquired
    assert store.release_permit(key, a)
    assert notifies() == 0  # nobody waited: no NOTIFY
    assert store.acquire_permit(key, a, "a", 30, one).acquired
    assert not store.acquire_permit(key, b, "b", 30, one).acquired  # a waiter's failed attempt
    assert store.release_permit(key, a)
    assert notifies() == 1
    # A writer refused by readers is woken by the last reader's release...
    reader, writer = owner(), owner()
    assert store.acquire_permit(key, reader, "r", 30, SHARED).acquired
    assert not store.acquire(key, writer, "w", 30).acquired
    assert store.release_permit(key, reader)
    assert notifies() == 1
    # ...and a reader refused by a writer by the writer's release.
    assert store.acquire(key, writer, "w", 30).acquired
    assert not store.acquire_permit(key, reader, "r", 30, SHARED).acquired
    assert store.release(key, writer)
    assert notifies() == 1


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_sqlite_permit_taken_inside_the_callers_transaction_is_undone_by_its_rollback(
    key: str,
) -> None:
    store = get_lock_store("sqlite")
    kept = owner()
    assert store.acquire_permit(key, kept, "kept", 30, THREE).acquired
    with pytest.raises(RuntimeError, match="roll back"):
        with transaction.atomic(using="default"):
            Group.objects.create(name=key[:150])
            assert store.acquire_permit(key, owner(), "undone", 30, THREE).acquired
            assert store.release_permit(key, kept)
            assert [i.holder for i in store.holders(key)] == ["undone"]
            raise RuntimeError("roll back the caller's transaction")
    assert [i.owner for i in store.holders(key)] == [kept]
    assert store.release_permit(key, kept)


def test_permits_left_by_an_expired_gate_count_for_nothing_and_their_slots_are_reused(
    db_alias: str, key: str
) -> None:
    store = get_lock_store(db_alias)
    left, writer = owner(), owner()
    assert store.acquire_permit(key, left, "left", 0.3, semaphore_mode(1)).acquired
    time.sleep(0.45)
    taken = store.acquire(key, writer, "w", 30)  # the unchanged exclusive path: rows stay
    assert taken.acquired and permit_rows(db_alias, key) == 1
    assert not store.extend_permit(key, left, 30)
    assert not store.release_permit(key, left)
    assert permit_rows(db_alias, key) == 1  # a free slot now
    assert [(i.owner, i.mode) for i in store.holders(key)] == [(writer, "exclusive")]
    assert store.release(key, writer)
    assert store.acquire(key, writer, "w", 0.3).acquired
    time.sleep(0.45)
    # The same owner as the leftover's: neither a duplicate nor counted against the limit.
    again = store.acquire_permit(key, left, "again", 30, semaphore_mode(1))
    assert again.acquired and again.fence is not None and taken.fence is not None
    assert again.fence > taken.fence
    assert [i.holder for i in store.holders(key)] == ["again"]
    assert permit_rows(db_alias, key) == 1  # the leftover's slot, filled again
    assert store.release_permit(key, left)


def test_permit_cycles_rewrite_the_keys_slots_instead_of_adding_rows(
    db_alias: str, key: str
) -> None:
    """A busy key keeps one row per permit it held at a time, each rewritten in place: rows
    deleted and inserted per permit would leave PostgreSQL dead rows and index entries that
    slow every later permit of the key until vacuum."""
    store = get_lock_store(db_alias)
    rows = Permit.objects.using(database_of(db_alias)).filter(key=key)
    three = [owner() for _ in range(3)]
    for me in three:
        assert store.acquire_permit(key, me, "h", 30, THREE).acquired
    assert not store.acquire_permit(key, owner(), "h", 30, THREE).acquired
    for me in three:
        assert store.release_permit(key, me)
    ids = set(rows.values_list("id", flat=True))
    assert len(ids) == 3  # released, they stay: free slots
    for cycle in range(300):
        held = [owner() for _ in range(cycle % 3 + 1)]
        for me in held:
            assert store.acquire_permit(key, me, "h", 30, THREE).acquired
        assert len(store.holders(key)) == len(held)
        for me in held[cycle % 2 :] + held[: cycle % 2]:
            assert store.release_permit(key, me)
    assert set(rows.values_list("id", flat=True)) == ids
    assert sorted(rows.values_list("slot", flat=True)) == [0, 1, 2]
    assert store.holders(key) == []


def test_no_index_holds_a_column_a_grant_or_release_writes(db_alias: str) -> None:
    """So that on PostgreSQL rewriting a slot is a HOT update, which its pages make room for."""
    database = database_of(db_alias)
    connection = connections[database]
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, Permit._meta.db_table)
        indexes = [c for c in found.values() if c["index"] or c["unique"] or c["primary_key"]]
        indexed = {column for index in indexes for column in index["columns"]}
        assert indexed == {"id", "key", "slot"}
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT reloptions FROM pg_class WHERE relname = %s", ["django_keel_lock_permit"]
            )
            assert cursor.fetchone()[0] == ["fillfactor=50"]


def test_exclusive_refusal_says_how_long_and_how_the_key_is_held(db_alias: str, key: str) -> None:
    store = get_lock_store(db_alias)
    holder = owner()
    assert store.acquire(key, holder, "h", 2).acquired
    refused = store.acquire(key, owner(), "x", 5)
    assert refused.held_as == "exclusive"
    assert refused.retry_in is not None and 1 < refused.retry_in <= 2.01  # SQLite: julian days
    assert store.release(key, holder)
    reader = owner()
    assert store.acquire_permit(key, reader, "r", 3, SHARED).acquired
    refused = store.acquire(key, owner(), "x", 5)
    assert refused.held_as == "shared" and refused.retry_in is not None
    assert 2 < refused.retry_in <= 3.01
    assert store.release_permit(key, reader)


def test_iter_locks_lists_each_permit_in_key_order_across_pages(
    db_alias: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("django_keel_lock.stores.database.store.PAGE_SIZE", 2)
    store = get_lock_store(db_alias)
    taken = []
    for name, mode, count in (("a", EXCLUSIVE, 1), ("b", SHARED, 3), ("c", THREE, 2)):
        for n in range(count):
            me = owner()
            taken.append((f"{key}:{name}", me))
            if mode is EXCLUSIVE:
                assert store.acquire(f"{key}:{name}", me, f"{name}{n}", 30).acquired
            else:
                assert store.acquire_permit(f"{key}:{name}", me, f"{name}{n}", 30, mode).acquired
    assert store.acquire(f"{key}:d", owner(), "d", 30).acquired
    listed = list(store.iter_locks(prefix=key))
    assert [i.key for i in listed] == sorted(i.key for i in listed)
    assert {(i.key, i.owner) for i in listed} >= set(taken)
    assert [i.mode for i in listed] == [
        "exclusive",
        *["shared"] * 3,
        *["semaphore"] * 2,
        "exclusive",
    ]
    assert not any(i.is_gate for i in listed)


def test_prune_deletes_expired_permits_and_fences_still_increase(db_alias: str, key: str) -> None:
    store = get_lock_store(db_alias)
    fences = []
    for _ in range(2):
        me = owner()
        result = store.acquire_permit(key, me, "short", 0.2, THREE)
        assert result.fence is not None
        fences.append(result.fence)
        time.sleep(0.35)
        assert permit_rows(db_alias, key) == 1
        assert store.prune() >= 1
        assert permit_rows(db_alias, key) == 0
    assert fences[1] > fences[0]
    after = store.acquire(key, owner(), "x", 1).fence
    assert after is not None and after > fences[1]


@needs_store("postgres")
def test_postgres_permits_work_without_the_libpq_path(key: str) -> None:
    """With prepared statements off (pgbouncer) the functions are called through psycopg's
    cursor, with its own parameter types."""
    with database_like("postgres", "postgres-unprepared", OPTIONS={"prepare_threshold": None}):
        store = DatabaseLockStore("unprepared", {"DATABASE": "postgres-unprepared"})
        try:
            a, b = owner(), owner()
            assert store.acquire_permit(key, a, "a", 30, semaphore_mode(1)).acquired
            refused = store.acquire_permit(key, b, "b", 30.5, semaphore_mode(1), writer_wait=1)
            assert refused.held_as == "semaphore" and refused.retry_in is not None
            assert store.extend_permit(key, a, 60)
            assert store.acquire(key, b, "b", 30).held_as == "semaphore"
            assert store.release_permit(key, a) and not store.release_permit(key, a)
            assert store._connection()[0].libpq is None
        finally:
            store.close()


@pytest.mark.parametrize("server", store_params(["postgres", "mariadb"]))
def test_key_the_column_cannot_hold_is_a_value_error_and_the_store_goes_on(
    server: str, key: str
) -> None:
    store = get_lock_store(server)
    too_long = "k" * 300
    for call in (
        lambda: store.acquire_permit(too_long, owner(), "h", 30, THREE),
        lambda: store.acquire_permit(too_long, owner(), "h", 30, EXCLUSIVE),
    ):
        with pytest.raises(ValueError, match="cannot store key"):
            call()
    me = owner()
    assert store.acquire_permit(key, me, "h", 30, THREE).acquired
    assert store.release_permit(key, me)
