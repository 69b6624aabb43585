"""What only the database store must get right: transactions, the database clock, outages."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.test import override_settings

from django_keel_lock import LockStoreUnavailable, get_lock_store, lock
from django_keel_lock.models import Lock
from django_keel_lock.stores import DatabaseLockStore

from .conftest import (
    TimeLimit,
    database_like,
    database_of,
    interrupted_after,
    needs,
    needs_store,
    serving,
)
from .support import ROOT
from .support.redis_servers import FaultyProxy, check_lost_release_reply
from .support.threads import call_in_thread

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def run_child(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> list[Any]:
    """Run tests.support.child with `args`; its JSON lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.child", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _database_of(alias: str) -> str:
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    return store.database


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_lock_taken_inside_atomic_survives_rollback_and_is_visible_at_once(
    server_alias: str, key: str
) -> None:
    database = _database_of(server_alias)
    seen_from_other_thread: list[bool] = []
    handle = lock(key, store=server_alias)
    with pytest.raises(RuntimeError, match="roll back"):
        with transaction.atomic(using=database):
            Group.objects.using(database).create(name=key[:150])
            assert handle.acquire()
            probe = threading.Thread(
                target=lambda: seen_from_other_thread.append(
                    lock(key, store=server_alias).acquire()
                )
            )
            probe.start()
            probe.join()
            raise RuntimeError("roll back the caller's transaction")
    assert seen_from_other_thread == [False]  # held, and visible outside the transaction
    assert not Group.objects.using(database).filter(name=key[:150]).exists()
    assert handle.is_locked()
    assert handle.release()


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_acquire_never_waits_behind_a_callers_open_transaction(server_alias: str, key: str) -> None:
    database = _database_of(server_alias)
    inside = threading.Event()
    finish = threading.Event()

    def caller() -> None:
        with transaction.atomic(using=database):
            Group.objects.using(database).create(name=key[:150])
            assert lock(key, store=server_alias).run(lambda: None).acquired
            inside.set()
            finish.wait(10)
        connections[database].close()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        assert lock(key, store=server_alias).run(lambda: True) == (True, True)
        assert time.monotonic() - started < 1.0
    finally:
        finish.set()
        thread.join()


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_callers_transaction_stays_usable_after_a_store_failure(
    server_alias: str, key: str
) -> None:
    database = _database_of(server_alias)
    with transaction.atomic(using=database):
        Group.objects.using(database).create(name=key[:150])
        with pytest.raises(ValueError, match="key"):
            lock("x" * 300, store=server_alias)
        assert lock(key, store=server_alias).run(lambda: 1) == (True, 1)
        assert Group.objects.using(database).filter(name=key[:150]).count() == 1


@needs(os.path.exists(FAKETIME_LIB), "libfaketime (apt-get install faketime)")
@pytest.mark.parametrize("skew", ["+2h", "-2h"])
def test_app_server_clock_skew_neither_steals_nor_keeps_locks(
    server_alias: str, key: str, skew: str
) -> None:
    # Server databases only: SQLite runs inside each process, so its "now" is the process's
    # clock; processes sharing one SQLite file share one machine and so one clock.
    db_alias = server_alias
    skewed = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": skew, "FAKETIME_DONT_RESET": "1"}
    # The skewed process really runs with a shifted clock.
    [child_clock] = run_child("acquire", "--store", db_alias, "--key", key + ":probe", env=skewed)
    assert abs(child_clock["wall"] - time.time()) > 3600

    holder = lock(key, ttl=30, store=db_alias)
    assert holder.acquire()
    # A process two hours ahead must not see our 30 s lock as expired.
    [stolen] = run_child("acquire", "--store", db_alias, "--key", key, env=skewed)
    assert stolen["acquired"] is False
    assert holder.release()

    # A lock taken by a skewed process lives exactly its ttl by the database's clock. The ttl
    # leaves a busy machine seconds between the child's acquire and our attempt.
    [taken] = run_child("acquire", "--store", db_alias, "--key", key, "--ttl", "3", env=skewed)
    returned = time.monotonic()
    assert taken["acquired"] is True and 2.5 < taken["remaining"] <= 3.01
    assert not lock(key, store=db_alias).acquire()
    time.sleep(max(0.0, returned + 3.2 - time.monotonic()))
    late = lock(key, store=db_alias)
    assert late.acquire()
    assert late.fence is not None and late.fence > taken["fence"]
    late.release()


def test_serialized_lock_is_released_by_another_process(db_alias: str, key: str) -> None:
    [child] = run_child("acquire", "--store", db_alias, "--key", key, "--ttl", "30")
    assert child["acquired"]
    assert not lock(key, store=db_alias).acquire()
    [extended] = run_child("restore-extend", "--token", child["token"], "--ttl", "60")
    assert 59 < extended["remaining"] <= 60.01
    [released] = run_child("restore-release", "--token", child["token"])
    assert released == {"released": True}
    assert lock(key, store=db_alias).run(lambda: "mine") == (True, "mine")
    [again] = run_child("restore-release", "--token", child["token"])
    assert again == {"released": False}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


DOWN_DATABASES = {
    "postgres": {"ENGINE": "django.db.backends.postgresql", "USER": "postgres", "NAME": "x"},
    "mariadb": {"ENGINE": "django.db.backends.mysql", "USER": "root", "NAME": "x"},
}


@pytest.fixture
def down_database() -> Iterator[Callable[[str], str]]:
    """Register a Django database alias whose server port is closed; its name."""
    added: list[str] = []

    def add(engine: str) -> str:
        alias = f"down-{engine}"
        config = {**DOWN_DATABASES[engine], "HOST": "127.0.0.1", "PORT": _closed_port()}
        # override_settings(DATABASES=...) does not reach django.db.connections; add it there.
        configured = connections.configure_settings(
            {"default": connections.settings["default"], alias: config}
        )
        connections.settings[alias] = configured[alias]
        added.append(alias)
        return alias

    yield add
    for alias in added:
        del connections.settings[alias]


@pytest.mark.parametrize("engine", ["postgres", "mariadb"])
def test_unreachable_database_is_an_error_not_contention(
    engine: str, key: str, down_database: Callable[[str], str]
) -> None:
    database = down_database(engine)
    stores = {
        "down": {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": database},
        }
    }
    with override_settings(KEEL_LOCK_STORES=stores):
        handle = lock(key, store="down")
        calls: list[int] = []
        operations: list[Callable[[], object]] = [
            handle.acquire,
            handle.is_locked,
            lambda: handle.run(lambda: calls.append(1)),
            lambda: lock(key, store="down", timeout=1).__enter__(),
        ]
        for operation in operations:
            with pytest.raises(LockStoreUnavailable, match="cannot connect"):
                operation()
        assert calls == []


def test_connection_killed_by_the_server_is_replaced_transparently(
    server_alias: str, key: str
) -> None:
    store = get_lock_store(server_alias)
    assert isinstance(store, DatabaseLockStore)
    handle = lock(key, store=server_alias)
    assert handle.acquire()
    wrapper = store._connection()[0].wrapper
    with connections[store.database].cursor() as cursor:
        pid = _backend_id(wrapper)
        kill = (
            "SELECT pg_terminate_backend(%s)" if store.dialect.vendor == "postgresql" else "KILL %s"
        )
        cursor.execute(kill, [pid])
    time.sleep(0.2)
    assert handle.release() is True  # retried once on a fresh connection
    assert not handle.is_locked()


def _backend_id(wrapper: Any) -> int:
    raw = wrapper.connection
    cursor = raw.cursor()
    cursor.execute(
        "SELECT pg_backend_pid()" if wrapper.vendor == "postgresql" else "SELECT CONNECTION_ID()"
    )
    value = int(cursor.fetchone()[0])
    cursor.close()
    return value


@contextmanager
def acquire_in_flight(store: DatabaseLockStore, key: str) -> Iterator[None]:
    """Another connection runs the store's own acquire statement for `key` and has not yet
    committed: an acquire caught between drawing its fence and finishing."""
    wrapper = store._new_wrapper()
    try:
        wrapper.set_autocommit(False)
        params = store.dialect.acquire_params(key, "in-flight", "test", 30)[0]
        with wrapper.cursor() as cursor:
            cursor.execute(store.dialect.acquire_sql[0], params)
        yield
        wrapper.commit()
    finally:
        wrapper.close()


def test_prune_waits_for_acquires_in_flight(server_alias: str, key: str) -> None:
    # An acquire draws the fence it would insert before it looks for the key's row; had prune
    # deleted that row in between, the insert would carry a fence below the deleted row's.
    store = get_lock_store(server_alias)
    assert isinstance(store, DatabaseLockStore)
    assert lock(f"{key}:dead", ttl=0.1, store=server_alias).acquire()
    time.sleep(0.2)
    with acquire_in_flight(store, f"{key}:in-flight"):
        thread, outcome = call_in_thread(store, store.prune)
        thread.join(0.5)
        assert thread.is_alive() and outcome == []  # held off until the acquire commits
    thread.join(10)
    assert outcome and isinstance(outcome[0], int) and outcome[0] >= 1, outcome
    assert store.get(f"{key}:dead") is None
    assert store.get(f"{key}:in-flight") is not None


def test_prune_gives_up_rather_than_stall_acquires(server_alias: str, key: str) -> None:
    store = get_lock_store(server_alias)
    assert isinstance(store, DatabaseLockStore)
    with acquire_in_flight(store, f"{key}:in-flight"):
        thread, outcome = call_in_thread(store, store.prune)
        thread.join(10)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], LockStoreUnavailable), outcome
    # Nothing of the attempt stays behind: locking and pruning work as before.
    handle = lock(key, store=server_alias)
    assert handle.acquire() and handle.release()
    assert store.prune() >= 1


def test_prune_deletes_in_batches_until_none_are_left(
    db_alias: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = get_lock_store(db_alias)
    store.prune()
    monkeypatch.setattr("django_keel_lock.stores.database.store.PRUNE_BATCH", 2)
    for n in range(5):
        assert lock(f"{key}:{n}", ttl=0.1, store=db_alias).acquire()
    keeper = lock(f"{key}:live", ttl=30, store=db_alias)
    assert keeper.acquire()
    time.sleep(0.2)
    # SQLite keeps the row with the highest fence (its fence counter), here the keeper's; the
    # row it kept before may be pruned now too.
    assert store.prune() >= 5
    assert [info.key for info in store.iter_locks(prefix=key)] == [keeper.key]
    assert keeper.release()


@contextmanager
def proxied(alias: str) -> Iterator[tuple[DatabaseLockStore, FaultyProxy]]:
    """A store on the same database as the store `alias`, reached through a FaultyProxy."""
    database = _database_of(alias)
    proxy = FaultyProxy(int(connections.settings[database]["PORT"]))
    try:
        with database_like(database, f"{database}-proxied", PORT=proxy.port) as through:
            store = DatabaseLockStore(f"{alias}-proxied", {"DATABASE": through})
            with serving(store):
                yield store, proxy
    finally:
        proxy.close()


def test_release_whose_reply_is_lost_is_an_error_not_a_retried_false(
    server_alias: str, key: str
) -> None:
    """The release committed, its reply never came. Retried, it would find the lock gone and
    report it lost; instead the caller hears of the outage, and the lock was released once."""
    with proxied(server_alias) as (store, proxy):
        warm_up = lock(f"{key}:warm-up", store=store.alias)  # PostgreSQL prepares on first use
        assert warm_up.acquire() and warm_up.release()
        check_lost_release_reply(proxy, store, key)


@needs_store("postgres")
def test_prune_interrupted_while_waiting_leaves_no_table_lock_behind(key: str) -> None:
    """A task's time limit (here a signal) interrupts prune while it waits for the table lock:
    its connection goes, rather than get the lock later and keep every acquire waiting."""
    store = get_lock_store("postgres")
    assert isinstance(store, DatabaseLockStore)
    with acquire_in_flight(store, f"{key}:in-flight"):
        with pytest.raises(TimeLimit), interrupted_after(0.3):
            store.prune()
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(lock(key, store="postgres").acquire()))
    thread.start()
    thread.join(5)
    assert done == [True], "an acquire still waits behind the interrupted prune"
    assert lock(key, store="postgres").acquire() is False


def _prepared_statements(store: DatabaseLockStore) -> list[str]:
    """The prepared statements on the calling thread's lock connection (server-side view)."""
    wrapper = store._connection()[0].wrapper
    with wrapper.connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture
def postgres_alias_with() -> Iterator[Callable[[dict[str, Any]], str]]:
    """Register a copy of the `postgres` database alias with other driver OPTIONS; its name."""
    with ExitStack() as stack:

        def add(options: dict[str, Any]) -> str:
            name = f"postgres-{uuid.uuid4().hex[:8]}"
            return stack.enter_context(database_like("postgres", name, OPTIONS=options))

        yield add


@needs_store("postgres")
def test_postgres_hot_statements_are_prepared_once_per_connection(key: str) -> None:
    store = DatabaseLockStore("prepared", {"DATABASE": "postgres"})
    try:
        for _ in range(3):
            assert store.acquire(key, "owner", "holder", 30).acquired
            assert store.extend(key, "owner", 30)
            assert store.release(key, "owner")
        names = _prepared_statements(store)
        # The acquire, the extend, the release, and the retake of a key freed last.
        assert len([n for n in names if n.startswith("keel_lock_")]) == 4, names
    finally:
        store.close()


def test_a_database_with_autocommit_off_still_commits_each_lock_statement(
    db_alias: str, key: str
) -> None:
    """A project may turn AUTOCOMMIT off for its database: the store's own connection commits
    each lock statement all the same, so another process sees the lock at once."""
    base = database_of(db_alias)
    with database_like(base, f"{base}-no-autocommit", AUTOCOMMIT=False) as database:
        store = DatabaseLockStore("no-autocommit", {"DATABASE": database, "SOCKET_TIMEOUT": 2})
        other = DatabaseLockStore("elsewhere", {"DATABASE": base, "SOCKET_TIMEOUT": 2})
        try:
            assert store.acquire(key, "a" * 32, "h", 30).acquired
            info = other.get(key)
            assert info is not None and info.owner == "a" * 32
            assert not other.acquire(key, "b" * 32, "h", 30).acquired
            assert store.release(key, "a" * 32)
            assert other.acquire(key, "b" * 32, "h", 30).acquired
            assert other.release(key, "b" * 32)
        finally:
            store.close()
            other.close()


@needs_store("mariadb")
def test_mariadb_project_options_neither_break_extend_nor_lose_their_session_settings(
    key: str,
) -> None:
    """A project's client_flag replaces the FOUND_ROWS flag Django asks for (an extend that
    leaves the expiry as it was would then count no row), and its init_command's session
    settings outlive a prune (which shortens lock_wait_timeout while it runs)."""
    options = {"client_flag": 0, "init_command": "SET SESSION lock_wait_timeout = 77"}
    with database_like("mariadb", "mariadb-options", OPTIONS=options) as database:
        store = DatabaseLockStore("mariadb-options", {"DATABASE": database})
        try:
            assert store.acquire(key, "a" * 32, "h", 30).acquired
            assert store.extend(key, "a" * 32, 1)  # GREATEST keeps the later expiry: no change
            store.prune()
            wrapper = store._connection()[0].wrapper
            with wrapper.connection.cursor() as cursor:
                cursor.execute("SELECT @@SESSION.lock_wait_timeout")
                assert int(cursor.fetchone()[0]) == 77
            assert store.release(key, "a" * 32)
        finally:
            store.close()


@needs_store("postgres")
def test_postgres_server_default_isolation_does_not_turn_contention_into_errors(
    key: str, postgres_alias_with: Callable[[dict[str, Any]], str]
) -> None:
    """With SERIALIZABLE as the session default, concurrent writes to one row fail to
    serialise; the store's connections run READ COMMITTED whatever the default."""
    database = postgres_alias_with({"options": "-c default_transaction_isolation=serializable"})
    store = DatabaseLockStore("serializable", {"DATABASE": database})
    errors: list[BaseException] = []
    acquired: list[int] = []

    def hammer() -> None:
        owner = uuid.uuid4().hex
        deadline = time.monotonic() + 1.5
        try:
            while time.monotonic() < deadline:
                if store.acquire(key, owner, "h", 30).acquired:
                    acquired.append(1)
                    assert store.release(key, owner)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        store.close()
    assert errors == [] and len(acquired) > 10


@needs_store("postgres")
def test_postgres_prepare_threshold_none_prepares_nothing_and_still_locks(
    key: str, postgres_alias_with: Callable[[dict[str, Any]], str]
) -> None:
    """pgbouncer in transaction mode needs prepared statements off; the user's choice wins."""
    database = postgres_alias_with({"prepare_threshold": None})
    store = DatabaseLockStore("unprepared", {"DATABASE": database})
    other = DatabaseLockStore("other", {"DATABASE": "postgres"})
    try:
        for _ in range(3):
            first = store.acquire(key, "a", "holder", 30)
            assert first.acquired
            assert not other.acquire(key, "b", "holder", 30).acquired
            assert store.extend(key, "a", 30)
            assert store.release(key, "a")
            assert not store.release(key, "a")
        assert _prepared_statements(store) == []
    finally:
        store.close()
        other.close()


@needs_store("postgres")
def test_postgres_prepared_statements_gone_from_the_session_are_recovered(key: str) -> None:
    """DISCARD ALL (a pooler resetting the session) drops them: the next call reconnects."""
    store = DatabaseLockStore("discarded", {"DATABASE": "postgres"})
    try:
        assert store.acquire(key, "owner", "holder", 30).acquired
        wrapper = store._connection()[0].wrapper
        with wrapper.connection.cursor() as cursor:
            cursor.execute("DISCARD ALL")
        assert store.release(key, "owner")
        assert store.acquire(key, "owner2", "holder", 30).acquired
        assert store.release(key, "owner2")
    finally:
        store.close()


@needs_store("postgres")
def test_durable_false_store_locks_the_same_way(key: str) -> None:
    fast, durable = lock(key, store="postgres-fast"), lock(key, store="postgres")
    assert fast.acquire()
    assert not durable.acquire()
    assert fast.release()
    assert durable.acquire() and durable.fence is not None and fast.fence is not None
    assert durable.fence > fast.fence
    durable.release()


def _on_store_connection(store: DatabaseLockStore, sql: str) -> list[Any]:
    """`sql`'s first column, run on the calling thread's lock connection."""
    wrapper = store._connection()[0].wrapper
    with wrapper.connection.cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


def _cycled(store: DatabaseLockStore, key: str) -> tuple[str, list[Any]]:
    """`store`'s session's synchronous_commit and its prepared lock statements, after its
    first connection and three acquire, extend and release cycles of `key`."""
    assert store.get(key) is None  # the first connection
    for _ in range(3):
        assert store.acquire(key, "owner", "holder", 30).acquired
        assert store.extend(key, "owner", 30)
        assert store.release(key, "owner")
    (setting,) = _on_store_connection(store, "SHOW synchronous_commit")
    statements = _on_store_connection(
        store, "SELECT statement FROM pg_prepared_statements WHERE name LIKE 'keel_lock_%'"
    )
    return setting, statements


@needs_store("postgres")
@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not-durable"])
def test_not_durable_says_synchronous_commit_once_on_its_own_session(
    key: str, durable: bool
) -> None:
    """Where the settings say no transaction pooler is in front, DURABLE: False turns
    synchronous_commit off on the store's session, once per connection, and its lock statements
    carry no set_config of their own (each statement's cost; behind a transaction pooler they
    do: see test_database_pooler). A durable store's session keeps the server's setting: its
    acquire waits for the flush, its release says otherwise for its own transaction. (The
    store's first connection tells whether a pooler is in front: a statement chosen before it
    says the setting itself, as behind one.)"""
    options = {"DATABASE": "postgres", "DURABLE": durable, "TRANSACTION_POOLER": False}
    store = DatabaseLockStore("session-flush", options)
    try:
        setting, statements = _cycled(store, key)
        assert len(statements) == 4, statements  # acquire, retake, extend, release
        carrying = [sql for sql in statements if "synchronous_commit" in sql]
        if durable:
            assert setting == "on"
            # The release (the database has the line's table) frees a lock nobody waits for
            # by an UPDATE that says it for its own transaction, and otherwise calls migration
            # 0009's function, which waits for the flush where it hands the lock over.
            releases = [sql for sql in statements if "django_keel_lock_release(" in sql]
            assert carrying == releases, carrying
            assert len(releases) == 1 and "true)" in releases[0], releases
        else:
            assert setting == "off"
            assert carrying == [], carrying
    finally:
        store.close()


def _release_function_calls(store: DatabaseLockStore) -> int:
    """How many calls of migration 0009's release function the database's statistics count
    (only sessions with track_functions on count: see the test below)."""
    _on_store_connection(store, "SELECT pg_stat_force_next_flush()")  # flushed once idle
    (calls,) = _on_store_connection(
        store,
        "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_user_functions "
        "WHERE funcname = 'django_keel_lock_release'",
    )
    return int(calls)


@needs_store("postgres")
@pytest.mark.parametrize("alias", ["postgres", "postgres-fast"])
def test_postgres_release_nobody_waits_for_is_one_update_without_the_release_function(
    key: str, alias: str
) -> None:
    """A release of a lock nobody waits for is the release statement's own UPDATE: the
    function that hands locks over (whose call costs as much again on the server) runs only
    where that UPDATE freed nothing: here, a lock already gone, which the release reports."""
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    # This session's calls count (the statistics count none by default).
    _on_store_connection(store, "SELECT set_config('track_functions', 'pl', false)")
    try:
        before = _release_function_calls(store)
        for _ in range(5):
            assert store.acquire(key, "owner", "holder", 30).acquired
            assert store.release(key, "owner")
        assert _release_function_calls(store) == before
        assert not store.release(key, "owner")  # gone already: the function says so
        assert _release_function_calls(store) == before + 1
    finally:
        _on_store_connection(
            store,
            "SELECT set_config(name, reset_val, false) FROM pg_settings "
            "WHERE name = 'track_functions'",
        )


_UPSERT, _RETAKE = "ON CONFLICT (key) DO UPDATE", "WHERE l.key = $5 AND"


def _runs(store: DatabaseLockStore, text: str) -> int:
    """How many times the store's session ran its prepared statement that contains `text`."""
    (count,) = _on_store_connection(
        store,
        "SELECT COALESCE(sum(generic_plans + custom_plans), 0)::bigint "
        f"FROM pg_prepared_statements WHERE statement LIKE '%{text}%' "
        "AND statement NOT LIKE '%pg_prepared_statements%'",  # this query, once prepared
    )
    return int(count)


@needs_store("postgres")
@pytest.mark.parametrize("alias", ["postgres", "postgres-fast"])
def test_postgres_lock_taken_again_after_its_free_release_is_one_update(
    key: str, alias: str
) -> None:
    """A thread that takes again the lock it freed last (nobody waiting) takes its row by a
    plain UPDATE, not the upsert, and gets a greater fence each time."""
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    assert store.get(key) is None  # connected: its statements counted from here
    upserts, retakes = _runs(store, _UPSERT), _runs(store, _RETAKE)
    fences = []
    for _ in range(4):
        result = store.acquire(key, "owner", "holder", 30)
        assert result.fence is not None
        fences.append(result.fence)
        assert store.release(key, "owner")
    assert fences == sorted(set(fences)), fences
    assert _runs(store, _UPSERT) == upserts + 1  # the first, a new row
    assert _runs(store, _RETAKE) == retakes + 3  # the three after it


@needs_store("postgres")
def test_postgres_lock_taken_by_another_since_its_free_release_is_refused_and_flagged(
    key: str,
) -> None:
    """A retake that finds the row taken since by another falls back to the upsert, which
    refuses with the time left and raises the row's waiting flag (so the holder's release
    wakes or hands over); once the holder releases, the lock is taken again."""
    ours = DatabaseLockStore("retake-ours", {"DATABASE": "postgres"})
    theirs = DatabaseLockStore("retake-theirs", {"DATABASE": "postgres"})
    try:
        first = ours.acquire(key, "a", "a", 30).fence
        assert first is not None and ours.release(key, "a")
        taken = theirs.acquire(key, "b", "b", 30).fence
        assert taken is not None and taken > first
        refused = ours.acquire(key, "a", "a", 30)
        assert refused.fence is None and refused.retry_in is not None and refused.retry_in > 25
        assert Lock.objects.using("postgres").get(key=key).waiting is True
        assert theirs.release(key, "b")
        again = ours.acquire(key, "a", "a", 30).fence
        assert again is not None and again > taken
        assert ours.release(key, "a")
        # Freed last, then deleted (as the clean-up does): the retake finds no row, the upsert
        # inserts it again.
        Lock.objects.using("postgres").filter(key=key).delete()
        last = ours.acquire(key, "a", "a", 30).fence
        assert last is not None and last > again
        assert ours.release(key, "a")
    finally:
        ours.close()
        theirs.close()


@needs_store("postgres")
def test_not_durable_found_without_a_pooler_keeps_the_setting_off_the_session(key: str) -> None:
    """TRANSACTION_POOLER left to be found out: a pooler may be found late (a vanished prepared
    statement), and a session it lends to others must not keep synchronous_commit off, so each
    write says it for its own transaction and the session keeps the server's setting."""
    store = DatabaseLockStore("found-flush", {"DATABASE": "postgres", "DURABLE": False})
    try:
        setting, statements = _cycled(store, key)
        assert setting == "on"
        carrying = [sql for sql in statements if "synchronous_commit" in sql]
        assert len(carrying) == 4, statements  # the acquire, the retake, the extend, the release
    finally:
        store.close()


def test_unknown_database_alias_is_a_clear_error(key: str) -> None:
    stores = {
        "bad": {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": "nope"},
        }
    }
    with override_settings(KEEL_LOCK_STORES=stores):
        with pytest.raises(ImproperlyConfigured, match="DATABASE 'nope'"):
            lock(key, store="bad")


def test_unknown_option_names_the_option() -> None:
    with pytest.raises(ImproperlyConfigured, match="DURABEL"):
        DatabaseLockStore("x", {"DURABEL": False})


@needs_store("postgres")
def test_closing_the_store_inside_an_event_loop_frees_its_connections(key: str) -> None:
    store = DatabaseLockStore("closing", {"DATABASE": "postgres"})
    assert store.acquire(key, "owner", "holder", 30).acquired
    wrapper = store._connection()[0].wrapper
    backend = _backend_id(wrapper)
    assert store.release(key, "owner")

    async def close_from_async_code() -> None:
        store.close()  # Django's own close() refuses to run here

    asyncio.run(close_from_async_code())
    time.sleep(0.2)
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend])
        assert cursor.fetchone()[0] == 0


@needs_store("postgres")
def test_postgres_listener_socket_has_keepalives_and_a_tcp_user_timeout(key: str) -> None:
    """Its socket carries TCP keepalives and a TCP user timeout (ten seconds), so a link that
    died silently fails the listener (waiters fall back to polling) instead of leaving it
    "ready" for TCP's ~15 minutes of retransmissions."""
    store = get_lock_store("postgres")
    assert isinstance(store, DatabaseLockStore)
    with store.watch(key):
        deadline = time.monotonic() + 10
        while not store.push_wakeups and time.monotonic() < deadline:
            time.sleep(0.02)
        listener = store._listener
        assert store.push_wakeups and listener is not None
        fileno = getattr(listener, "fileno", None)
        assert fileno is not None
        sock = socket.socket(fileno=os.dup(fileno))
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
        finally:
            sock.close()


def test_waiter_in_another_process_wakes_on_release_not_on_its_poll(
    server_alias: str, key: str
) -> None:
    """PostgreSQL's NOTIFY, MariaDB's doorbell (see MySQLDialect)."""
    holder = lock(key, ttl=30, store=server_alias)
    assert holder.acquire()
    other = lock(f"{key}:other", ttl=30, store=server_alias)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.child",
            "acquire",
            "--store",
            server_alias,
            "--key",
            key,
            "--timeout",
            "20",
            "--retry-delay",
            "10",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not _waited_for(server_alias, key) and time.monotonic() < deadline:
            time.sleep(0.05)  # the child's first attempt, refused, raises the row's flag
        time.sleep(1.0)  # the child is waiting, its listener subscribed to its key
        assert other.acquire() and other.release()  # another key's release wakes nobody there
        released_at = time.monotonic()
        assert holder.release()
        line = child.stdout.readline() if child.stdout else ""
        result = json.loads(line)
        assert result["acquired"] is True
        assert result["at"] - released_at < 1.0  # its poll was 5 s at the soonest: pushed
    finally:
        child.kill()
        child.communicate(timeout=10)


def _waited_for(alias: str, key: str) -> bool:
    """Whether `key`'s row has its `waiting` flag raised."""
    rows = Lock.objects.using(_database_of(alias)).filter(key=key, waiting=True)
    return rows.exists()


def _backends() -> int:
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


@needs_store("postgres")
def test_threads_that_end_take_their_connection_with_them(key: str) -> None:
    store = DatabaseLockStore("threads", {"DATABASE": "postgres"})
    before = _backends()
    for index in range(20):
        worker = threading.Thread(
            target=lambda i=index: (
                store.release(key, "o") or store.acquire(f"{key}:{i}", "o", "h", 5)
            )
        )
        worker.start()
        worker.join()
    time.sleep(0.3)
    assert _backends() <= before + 1, "a connection stayed open for a thread that ended"
    store.close()


@needs_store("postgres")
def test_a_forked_child_closing_the_store_leaves_the_parents_connection_alone(key: str) -> None:
    store = DatabaseLockStore("forked", {"DATABASE": "postgres"})
    assert store.acquire(key, "parent", "h", 30).acquired
    wrapper = store._connection()[0].wrapper
    backend = _backend_id(wrapper)
    pid = os.fork()
    if pid == 0:  # the child: close the inherited store, then leave without cleanup
        store.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert _backend_id(wrapper) == backend  # same session, not killed and reopened
    assert store.release(key, "parent")
    store.close()


@needs_store("postgres")
@pytest.mark.django_db(databases="__all__", transaction=True)
def test_postgres_release_notifies_only_when_someone_failed_to_get_the_lock(
    key: str, postgres_notifications: Callable[[str], Callable[[], int]]
) -> None:
    store = get_lock_store("postgres")
    notifies = postgres_notifications(key)
    assert store.acquire(key, "a", "h", 30).acquired
    assert store.release(key, "a")
    assert notifies() == 0  # nobody waited: no NOTIFY
    assert store.acquire(key, "a2", "h", 30).acquired
    assert not store.acquire(key, "b", "h", 30).acquired  # a waiter's failed attempt
    assert not store.acquire(key, "c", "h", 30).acquired
    assert store.acquire(key, "a2", "h", 30).acquired  # the holder's own retry keeps the flag
    assert store.release(key, "a2")
    assert notifies() == 1
    assert store.acquire(key, "b", "h", 30).acquired  # a new holder lowers the flag...
    assert not store.acquire(key, "c", "h", 30).acquired  # ...until the next waiter fails
    assert store.release(key, "b")
    assert notifies() == 1
    assert store.acquire(key, "c", "h", 30).acquired
    assert store.release(key, "c")
    assert notifies() == 0


def test_migrations_match_the_model() -> None:
    from django.core.management import call_command

    call_command("makemigrations", "django_keel_lock", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_sqlite_keeps_its_fence_index_through_the_migrations() -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = %s",
            ["django_keel_lock_lock"],
        )
        names = {row[0] for row in cursor.fetchall()}
    assert "django_keel_lock_lock_fence" in names, names
