"""The database store behind poolers (issue 35): a real PgBouncer in transaction mode
(tests/support/pgbouncer.py, Debian's 1.18: it carries no prepared statements) and Django's own
pool. Lock operations leave nothing on a pooled session, the listener LISTENs only where a
session is its own (LISTEN_DATABASE), a pooler is found (and check W012 says what it turns
off), mutual exclusion holds across processes, and 32 threads leak no connection of Django's
pool. The contract suite runs through both in tests/test_database_pooler_contract.py."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.db import connections, transaction

from django_keel_lock import get_lock_store, lock
from django_keel_lock.stores import DatabaseLockStore, semaphore_mode
from tests.support.pgbouncer import PgBouncer, pgbouncer
from tests.support.poolers import POOLED_STORES, pooled
from tests.support.threads import call_in_thread
from tests.test_multiprocess import (
    test_many_processes_never_overlap_and_counter_is_exact as never_overlap,
)

__all__ = ["pooled"]

#: Session state a pooler does not manage itself (it re-sends these per client).
_TRACKED = (
    "('TimeZone', 'client_encoding', 'DateStyle', 'standard_conforming_strings', "
    "'application_name')"
)


def _db_store(alias: str) -> DatabaseLockStore:
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    return store


def _client(bouncer: PgBouncer) -> psycopg.Connection[tuple[object, ...]]:
    """A plain client of the test database through `bouncer` (no prepared statements)."""
    name = connections.settings["postgres"]["NAME"]
    return psycopg.connect(
        host=bouncer.host, port=bouncer.port, user=bouncer.user, dbname=str(name),
        autocommit=True, prepare_threshold=None,
    )  # fmt: skip


def _session_state(bouncer: PgBouncer) -> dict[str, object]:
    """What the server connection a new client of `bouncer` gets carries from before it:
    settings set on the session, prepared statements, LISTENs, advisory locks."""
    with _client(bouncer) as client:
        return {
            "settings": client.execute(
                "SELECT name, setting FROM pg_settings WHERE source = 'session' "
                f"AND name NOT IN {_TRACKED} ORDER BY name"
            ).fetchall(),
            "prepared": client.execute("SELECT name FROM pg_prepared_statements").fetchall(),
            "listening": client.execute("SELECT pg_listening_channels()").fetchall(),
            "advisory": client.execute(
                "SELECT objid FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            ).fetchall(),
        }


@pytest.fixture
def one_server_connection() -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode with one server connection: every client's statements
    run on it, so whatever one leaves on the session the next one finds."""
    with pgbouncer(connections.settings["postgres"], pool_size=1) as bouncer:
        yield bouncer


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not-durable"])
def test_no_lock_operation_leaves_session_state_on_a_pooled_server_connection(
    one_server_connection: PgBouncer, pooled: PgBouncer, durable: bool, key: str
) -> None:
    """Every kind of operation (exclusive, queued, shared, semaphore, multi-key, reads, prune,
    a clean-up round), then a second client on the same server connection finds nothing of
    ours: no SET (DURABLE: False's synchronous_commit is each write's own), no prepared
    statement, no LISTEN. Before pooler support, the first acquire failed on a prepared
    statement and the connection set the session's isolation level."""
    bouncer = one_server_connection
    alias = f"one-conn-{uuid.uuid4().hex[:6]}"
    connections.settings[alias] = bouncer.settings(connections.settings["postgres"])
    store = DatabaseLockStore(alias, {"DATABASE": alias, "DURABLE": durable})
    try:
        assert _session_state(bouncer) == {
            "settings": [], "prepared": [], "listening": [], "advisory": [],
        }  # fmt: skip
        owner = uuid.uuid4().hex
        for _ in range(3):  # again: a statement would be prepared at its second run
            assert store.acquire(key, owner, "a", 30).acquired
            assert store.extend(key, owner, 40)
            assert not store.acquire_queued(key, "other" + owner[5:], "b", 30).acquired
            store.leave_queue(key, "other" + owner[5:])
            assert store.get(key) is not None and list(store.iter_locks(key))
            assert store.release(key, owner)
            assert store.acquire_permit(f"{key}:s", owner, "a", 30, semaphore_mode(2)).acquired
            assert store.extend_permit(f"{key}:s", owner, 40)
            assert store.holders(f"{key}:s")
            assert store.release_permit(f"{key}:s", owner)
            keys = (f"{key}:m1", f"{key}:m2")
            assert store.acquire_many(keys, owner, "a", 30).acquired
            assert not store.acquire_many(keys, "other" + owner[5:], "b", 30).acquired
            assert store.extend_many(keys, owner, 40)
            assert store.release_many(keys, owner)
        store._sweep(store._sweeps)
        store._sweep(store._sweeps)
        store.prune()
        assert store.vendor.pooled is True  # type: ignore[attr-defined]
        assert _session_state(bouncer) == {
            "settings": [], "prepared": [], "listening": [], "advisory": [],
        }  # fmt: skip
    finally:
        store.close()
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_behind_pgbouncer_four_processes_of_with_lock_all_get_in(pooled: PgBouncer) -> None:
    """The issue's run (118 of 160 raised LockStoreUnavailable): 4 processes x 40
    `with lock(key, timeout=10)`, all acquired."""
    key = f"pooled-run:{uuid.uuid4().hex}"
    context = multiprocessing.get_context("fork")
    with context.Pool(4) as pool:
        results = pool.map(_forty_withs, [key] * 4)
    assert results == [40] * 4


def _forty_withs(key: str) -> int:
    entered = 0
    for _ in range(40):
        with lock(key, timeout=10, store="pgbouncer-polling"):
            entered += 1
    return entered


@pytest.mark.parametrize("alias", POOLED_STORES)
def test_many_processes_never_overlap_through_a_pooler(
    pooled: PgBouncer, alias: str, tmp_path: Path
) -> None:
    """tests/test_multiprocess.py's mutual exclusion through PgBouncer (transaction mode) and
    Django's pool: 8 processes x 20 rounds of a non-atomic counter."""
    never_overlap(alias, f"pooled-mp:{uuid.uuid4().hex}", tmp_path)


def test_the_listener_listens_on_listen_database_and_a_release_wakes_at_once(
    pooled: PgBouncer, key: str
) -> None:
    """Through PgBouncer with LISTEN_DATABASE on the direct alias: the listener is up and a
    release wakes a waiter long before its next poll (retry_delay 5 s)."""
    store = _db_store("pgbouncer")
    holder = lock(key, ttl=30, store="pgbouncer")
    assert holder.acquire()
    got: list[float] = []

    def wait() -> None:
        waiter = lock(key, ttl=30, store="pgbouncer")
        assert waiter.acquire(timeout=20, retry_delay=5)
        got.append(time.monotonic())
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 10
    while not store.push_wakeups and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.push_wakeups, "the listener never came up on LISTEN_DATABASE"
    time.sleep(0.2)  # the waiter is waiting
    released = time.monotonic()
    assert holder.release()
    thread.join(20)
    assert got and got[0] - released < 2.0, "woken by its poll, not by the release"


def test_without_listen_database_the_store_behind_pgbouncer_polls(
    pooled: PgBouncer, key: str
) -> None:
    """No LISTEN on a pooled session: the listener gives up (waiters poll), and the lock is
    still handed over."""
    store = _db_store("pgbouncer-polling")
    holder = lock(key, ttl=30, store="pgbouncer-polling")
    assert holder.acquire()
    with store.watch(key):
        deadline = time.monotonic() + 10
        while store.push_possible and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not store.push_possible and not store.push_wakeups
    assert holder.release()
    assert lock(key, store="pgbouncer-polling").acquire(timeout=2, retry_delay=0.05)


def test_a_pooler_said_absent_is_found_by_its_lost_prepared_statements(
    pooled: PgBouncer, key: str
) -> None:
    """TRANSACTION_POOLER: False through PgBouncer (transaction mode): the prepared statements
    land on other server connections; the store notices (26000 / 42P05: the statement did not
    run), keeps nothing on sessions from then on, and every operation still succeeds."""
    store = DatabaseLockStore("said-direct", {"DATABASE": "pgbouncer", "TRANSACTION_POOLER": False})
    assert store.vendor.pooled is False  # type: ignore[attr-defined]

    def cycles(n: int) -> int:
        for i in range(30):
            owner = f"{n}-{i}-{uuid.uuid4().hex}"
            result = store.acquire(f"{key}:{n}", owner, "t", 30)
            assert result.acquired and store.release(f"{key}:{n}", owner)
        return 30

    try:
        running = [call_in_thread(store, lambda n=n: cycles(n)) for n in range(4)]
        for thread, _ in running:
            thread.join(60)
    finally:
        store.close()
    assert [outcome for _, outcome in running] == [[30]] * 4
    assert store.vendor.pooled is True  # type: ignore[attr-defined]


def test_check_w012_names_the_pooled_store_without_listen_database(pooled: PgBouncer) -> None:
    found = DatabaseLockStore.check_servers(
        {
            "behind": {"DATABASE": "pgbouncer"},
            "declared": {"DATABASE": "postgres", "TRANSACTION_POOLER": True},
            "listening": {"DATABASE": "pgbouncer", "LISTEN_DATABASE": "postgres"},
            "said-not": {"DATABASE": "pgbouncer", "TRANSACTION_POOLER": False},
            "direct": {"DATABASE": "postgres"},
            "django-pool": {"DATABASE": "django-pool"},
        },
        databases=["pgbouncer", "postgres", "django-pool"],
    )
    w012 = [m for m in found if m.id == "django_keel_lock.W012"]
    assert [m.msg.split("'")[1] for m in w012] == ["behind", "declared"]
    assert "LISTEN_DATABASE" in str(w012[0].hint) and "TRANSACTION_POOLER" in str(w012[0].hint)


def test_thirty_two_threads_on_djangos_pool_leak_no_connection(pooled: PgBouncer) -> None:
    """32 threads, each in the caller's atomic block on Django's pool (max 4) taking and
    giving back a lock of the store on the same database: the store's own connections never
    come from the pool, and every pooled connection is back once the threads closed theirs."""
    alias, key = "django-pool", f"pool-threads:{uuid.uuid4().hex}"
    connections[alias].close()  # this thread's, if an earlier test opened it
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(3):
                with transaction.atomic(using=alias):
                    with connections[alias].cursor() as cursor:
                        cursor.execute("SELECT 1")
                    with lock(f"{key}:{n % 4}", ttl=30, timeout=30, store=alias) as held:
                        assert held.fence is not None
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[alias].close()  # back to the pool, as at the end of a request

    threads = [threading.Thread(target=work, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    pool = connections[alias].pool
    stats = pool.get_stats()
    assert stats["pool_size"] <= 4
    assert stats["pool_available"] == stats["pool_size"], stats
    assert stats.get("requests_errors", 0) == 0, stats


def test_a_direct_connection_is_not_taken_for_a_pooler(pooled: PgBouncer, key: str) -> None:
    """The direct alias keeps its prepared statements and LISTEN; the PgBouncer one is found."""
    direct, behind = _db_store("postgres"), _db_store("pgbouncer-polling")
    for store in (direct, behind):
        owner = uuid.uuid4().hex
        assert store.acquire(key, owner, "t", 30).acquired and store.release(key, owner)
    assert direct.vendor.pooled is False  # type: ignore[attr-defined]
    assert behind.vendor.pooled is True  # type: ignore[attr-defined]
    assert direct._connection()[0].libpq.named  # type: ignore[union-attr]
    assert not behind._connection()[0].libpq.named  # type: ignore[union-attr]
