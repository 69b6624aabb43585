"""The database store behind a PgBouncer that talks over Unix sockets at both ends, Debian's
layout of a PgBouncer beside its server: the server sees no client address (NULL) and
neither does our socket, so comparing addresses alone took it for a direct connection (named
prepared statements and a SET SESSION left on pooled server connections). The backend pid
the server runs our statements in, beside the one PgBouncer told us at startup, gives it
away."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connections, transaction

from django_keel_lock.exceptions import LockStoreUnavailable
from django_keel_lock.stores import DatabaseLockStore
from tests.conftest import skip_or_fail
from tests.support.pgbouncer import PGBOUNCER, PgBouncer, pgbouncer
from tests.test_database_pooler import _client, _session_state


def _bouncer(**options: Any) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode with one server connection (`options`: pgbouncer()'s)."""
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    try:
        context = pgbouncer(connections.settings["postgres"], pool_size=1, **options)
        bouncer = context.__enter__()
    except FileNotFoundError:
        skip_or_fail(f"pgbouncer is not installed ({PGBOUNCER})")
    try:
        yield bouncer
    finally:
        context.__exit__(None, None, None)


@pytest.fixture
def unix_bouncer(_databases: None) -> Iterator[PgBouncer]:
    """One on Unix sockets at both ends."""
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SHOW unix_socket_directories")
        directory = cursor.fetchone()[0].split(",")[0].strip()
    if not directory:
        skip_or_fail("PostgreSQL listens on no Unix socket (unix_socket_directories = '')")
    yield from _bouncer(unix_sockets=directory)


@pytest.fixture
def one_server_connection(_databases: None) -> Iterator[PgBouncer]:
    """One on TCP."""
    yield from _bouncer()


def test_a_pgbouncer_on_unix_sockets_at_both_ends_is_found_and_keeps_nothing_of_ours(
    unix_bouncer: PgBouncer,
) -> None:
    """TRANSACTION_POOLER unset: the store's first connection finds the pooler (the server
    sees a Unix socket, as our side does, but another backend than PgBouncer named), and its
    operations leave nothing on the shared server connection (before: no pooler found, a
    SET SESSION CHARACTERISTICS and named prepared statements left for the next client)."""
    alias = f"unix-bouncer-{uuid.uuid4().hex[:6]}"
    connections.settings[alias] = unix_bouncer.settings(connections.settings["postgres"])
    store = DatabaseLockStore(alias, {"DATABASE": alias})
    key = f"unix-bouncer:{uuid.uuid4().hex}"
    try:
        owner = uuid.uuid4().hex
        for _ in range(3):  # a statement would be prepared at its second run
            assert store.acquire(key, owner, "a", 30).acquired
            assert store.extend(key, owner, 40)
            assert store.get(key) is not None
            assert store.release(key, owner)
        assert store.vendor.pooled is True  # type: ignore[attr-defined]
        assert _session_state(unix_bouncer) == {
            "settings": [], "prepared": [], "listening": [], "advisory": [],
        }  # fmt: skip
    finally:
        store.close()
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_a_pooler_found_late_turns_off_named_statements_on_connections_open_already(
    one_server_connection: PgBouncer,
) -> None:
    """TRANSACTION_POOLER: False through PgBouncer (one server connection): a thread's
    connection prepares the acquire; another thread's prepare of it finds it there (42P05),
    and the store says it keeps nothing on sessions from then on. The first thread's
    connection, open since before, then prepares nothing more: neither its extend (libpq) nor
    psycopg's own statements for a read it repeats (before: both were left on the shared
    server connection, where another client's statement of the same psycopg name could run in
    place of its own)."""
    bouncer = one_server_connection
    alias = f"late-bouncer-{uuid.uuid4().hex[:6]}"
    connections.settings[alias] = bouncer.settings(connections.settings["postgres"])
    store = DatabaseLockStore(alias, {"DATABASE": alias, "TRANSACTION_POOLER": False})
    key, owner = f"late-bouncer:{uuid.uuid4().hex}", uuid.uuid4().hex
    try:
        with ThreadPoolExecutor(1) as first:  # one thread: one connection of the store's
            assert first.submit(store.acquire, key, owner, "a", 30).result().acquired
            assert store.acquire(f"{key}:2", owner, "b", 30).acquired  # 42P05, then again
            assert store.vendor.pooled is True  # type: ignore[attr-defined]
            assert first.submit(store.extend, key, owner, 40).result()
            for _ in range(4):
                assert first.submit(store.get, key).result() is not None
            with _client(bouncer) as client:
                prepared = client.execute(
                    "SELECT name, statement FROM pg_prepared_statements"
                ).fetchall()
        assert [name for name, text in prepared if "GREATEST" in text] == []  # the extend
        assert [name for name, _ in prepared if name.startswith("_pg3_")] == []
    finally:
        store.close()
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_a_lock_inside_the_callers_transaction_on_the_pools_last_server_connection_fails_in_time(
    one_server_connection: PgBouncer,
) -> None:
    """The store's statements need a server connection besides the one the caller's open
    transaction pins: with none left in PgBouncer's pool they wait for one, so the acquire
    raises LockStoreUnavailable at SOCKET_TIMEOUT rather than hanging (what docs/stores.md
    says to size default_pool_size for)."""
    bouncer = one_server_connection
    alias = f"pinned-bouncer-{uuid.uuid4().hex[:6]}"
    connections.settings[alias] = bouncer.settings(connections.settings["postgres"])
    store = DatabaseLockStore(alias, {"DATABASE": alias, "SOCKET_TIMEOUT": 1})
    try:
        with transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT 1")  # the pool's one server connection is pinned now
            started = time.monotonic()
            with pytest.raises(LockStoreUnavailable):
                store.acquire(f"pinned:{uuid.uuid4().hex}", uuid.uuid4().hex, "a", 30)
            assert time.monotonic() - started < 4
    finally:
        store.close()
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def test_behind_a_pooler_a_default_isolation_above_read_committed_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Behind a transaction pooler the store cannot set READ COMMITTED on its session, so a
    role (or server) default of SERIALIZABLE makes contended acquires and releases fail on
    serialization errors (LockStoreUnavailable; 161 of 320 with 8 threads on one key). The
    store's first connection says so, and what to set (before: nothing said)."""
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    role, alias = f"keel_serializable_{os.getpid()}", f"serializable-{uuid.uuid4().hex[:6]}"
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        cursor.execute(f"ALTER ROLE {role} SET default_transaction_isolation = 'serializable'")
    connections.settings[alias] = {**connections.settings["postgres"], "USER": role}
    store = DatabaseLockStore(alias, {"DATABASE": alias, "TRANSACTION_POOLER": True})
    try:
        with caplog.at_level(logging.WARNING, logger="django_keel_lock"):
            owner = uuid.uuid4().hex
            assert store.acquire(f"serializable:{owner}", owner, "a", 30).acquired
            assert store.release(f"serializable:{owner}", owner)
        warned = [r.getMessage() for r in caplog.records if "serializable" in r.getMessage()]
        assert warned and "read committed" in warned[0], caplog.text
    finally:
        store.close()
        del connections.settings[alias]
        with connections["postgres"].cursor() as cursor:
            cursor.execute(f"DROP ROLE {role}")
