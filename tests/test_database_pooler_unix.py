"""The database store behind a PgBouncer that talks over Unix sockets at both ends, Debian's
layout of a PgBouncer beside its server: the server sees no client address (NULL) and
neither does our socket, so comparing addresses alone took it for a direct connection (named
prepared statements and a SET SESSION left on pooled server connections). The backend pid
the server runs our statements in, beside the one PgBouncer told us at startup, gives it
away."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connections

from django_keel_lock.stores import DatabaseLockStore
from tests.conftest import skip_or_fail
from tests.support.pgbouncer import PGBOUNCER, PgBouncer, pgbouncer
from tests.test_database_pooler import _session_state


@pytest.fixture
def unix_bouncer(_databases: None) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode, one server connection, Unix sockets at both ends."""
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SHOW unix_socket_directories")
        directory = cursor.fetchone()[0].split(",")[0].strip()
    if not directory:
        skip_or_fail("PostgreSQL listens on no Unix socket (unix_socket_directories = '')")
    try:
        context = pgbouncer(connections.settings["postgres"], pool_size=1, unix_sockets=directory)
        bouncer = context.__enter__()
    except FileNotFoundError:
        skip_or_fail(f"pgbouncer is not installed ({PGBOUNCER})")
    try:
        yield bouncer
    finally:
        context.__exit__(None, None, None)


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
