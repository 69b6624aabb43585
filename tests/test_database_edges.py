"""The database store at its edges: SQLite inside the caller's transaction, PostgreSQL databases
whose encoding is not UTF-8."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections

from django_keel_lock import LockStoreUnavailable, lock
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.dialects import TABLE

from .conftest import database_like, needs_store, serving

# The SQLite tests write to the test database in real transactions (flushed after); the
# PostgreSQL ones make a database of their own, out of reach of Django's test isolation.
writes_rows = pytest.mark.django_db(transaction=True)

# sqlite3 waits this long for another connection's write lock before "database is locked": a
# lock call that waited behind the caller's own transaction would take this long, then fail.
SQLITE_BUSY_WAIT = 5.0


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """The block must end (return or raise) within `seconds`: it must not wait on a lock."""
    started = time.monotonic()
    yield
    assert time.monotonic() - started < seconds


# -- PostgreSQL databases in another encoding --------------------------------------------------
@contextmanager
def latin1_database() -> Iterator[str]:
    """The alias of a new LATIN1 PostgreSQL database with the lock table, while the block runs;
    then the database is dropped. Close stores opened on it first."""
    base = connections["postgres"]
    name = f"{base.settings_dict['NAME']}_latin1_{uuid.uuid4().hex[:8]}"
    quoted = base.ops.quote_name(name)
    with base.cursor() as cursor:
        cursor.execute(
            f"CREATE DATABASE {quoted} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    try:
        with database_like("postgres", "latin1", NAME=name) as alias:
            call_command("migrate", "django_keel_lock", database=alias, verbosity=0)
            yield alias
    finally:
        with base.cursor() as cursor:
            cursor.execute(f"DROP DATABASE {quoted} WITH (FORCE)")


def waiting_flag(database: str, key: str) -> bool:
    with connections[database].cursor() as cursor:
        cursor.execute(f"SELECT waiting FROM {TABLE} WHERE key = %s", [key])
        row = cursor.fetchone()
    return bool(row and row[0])


@needs_store("postgres")
def test_postgres_latin1_database_release_wakes_a_waiter_on_a_non_ascii_key() -> None:
    """The release NOTIFYs on md5 of the key's UTF-8 bytes, the channel the listener computes
    in Python, whatever the server's encoding (md5 of LATIN1 bytes would be another channel:
    the waiter would sleep until its timeout)."""
    key = f"café:{uuid.uuid4().hex[:8]}"
    with latin1_database() as database:
        waiting_store = DatabaseLockStore("latin1-waiter", {"DATABASE": database})
        releasing_store = DatabaseLockStore("latin1-releaser", {"DATABASE": database})
        with serving(waiting_store) as waiting, serving(releasing_store) as releasing:
            holder = lock(key, store=releasing, ttl=30)
            assert holder.acquire()
            result: dict[str, Any] = {}

            def wait() -> None:
                waiter = lock(key, store=waiting, ttl=30, timeout=10, retry_delay=10)
                result["acquired"] = waiter.acquire()
                result["at"] = time.monotonic()
                if result["acquired"]:
                    waiter.release()

            thread = threading.Thread(target=wait)
            thread.start()
            deadline = time.monotonic() + 10
            listener = None
            while time.monotonic() < deadline:
                listener = waiting_store._listener
                subscribed = listener is not None and key in listener.subscribed
                if subscribed and waiting_flag(database, key):
                    break
                time.sleep(0.02)
            assert listener is not None and key in listener.subscribed
            released_at = time.monotonic()
            assert holder.release()
            thread.join(15)
            assert result["acquired"] is True
            assert result["at"] - released_at < 1.0  # its poll was 10 s: the NOTIFY woke it


@needs_store("postgres")
@pytest.mark.parametrize("character", ["ł", "€"])
def test_postgres_key_the_database_cannot_encode_is_a_value_error_naming_it(
    character: str,
) -> None:
    """Not LockStoreUnavailable after a reconnect: the database is fine, the key is not. The
    connection stays (it is healthy) and serves the next call."""
    key = f"price{character}:{uuid.uuid4().hex[:8]}"
    with latin1_database() as database:
        store = DatabaseLockStore("latin1", {"DATABASE": database})
        with serving(store) as alias:
            assert store.get("warm-up") is None
            connection = store._threads.get()
            with pytest.raises(ValueError, match=key) as raised:
                lock(key, store=alias, ttl=30).acquire()
            assert not isinstance(raised.value, LockStoreUnavailable)
            with pytest.raises(ValueError, match=key):
                store.get(key)
            with pytest.raises(ValueError, match=key):
                store.release(key, "0" * 32)
            assert store._threads.get() is connection
            fine = lock(f"plain:{uuid.uuid4().hex[:8]}", store=alias, ttl=30)
            assert fine.acquire() and fine.release()
            assert store._threads.get() is connection
