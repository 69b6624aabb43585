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
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path

from django_keel_lock import LockStoreUnavailable, get_lock_store, lock, lock_view
from django_keel_lock.models import Lock
from django_keel_lock.stores import DatabaseLockStore
from tests.testapp.models import Invoice

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


# -- SQLite inside transaction.atomic() ------------------------------------------------------
def free(key: str) -> bool:
    """Whether another connection (a thread of its own) can take `key` right now."""
    result: dict[str, Any] = {}

    def take() -> None:
        try:
            other = lock(key, store="sqlite", ttl=5)
            result["free"] = other.acquire()
            if result["free"]:
                other.release()
        except Exception as exc:  # reported below, in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(SQLITE_BUSY_WAIT * 2)
    assert "error" not in result, result
    return bool(result["free"])


@writes_rows
def test_sqlite_acquire_after_a_write_in_atomic_does_not_wait_behind_that_write(key: str) -> None:
    """The caller's transaction holds SQLite's write lock once it wrote; the store's own
    connection would wait for it (5 s, then "database is locked"). The lock joins the caller's
    transaction instead, on the caller's connection."""
    handle = lock(key, store="sqlite", ttl=30)
    with transaction.atomic():
        Invoice.objects.create()
        with within(SQLITE_BUSY_WAIT / 2):
            assert handle.acquire()
        info = get_lock_store("sqlite").get(key)
        assert info is not None and info.fence == handle.fence
        with within(SQLITE_BUSY_WAIT / 2):
            assert handle.release()
    assert free(key)


@writes_rows
def test_sqlite_acquire_write_release_in_atomic_leaves_the_key_free(key: str) -> None:
    """The ATOMIC_REQUESTS + @lock_view shape: acquire, then the view writes, then release,
    all in one transaction. The release must not wait behind the write (and fail, stranding
    the lock for its ttl); after the block nobody holds the key."""
    handle = lock(key, store="sqlite", ttl=300)
    with transaction.atomic():
        assert handle.acquire()
        Invoice.objects.create(status="written")
        with within(SQLITE_BUSY_WAIT / 2):
            assert handle.release()
    assert get_lock_store("sqlite").get(key) is None
    assert free(key)
    assert Invoice.objects.filter(status="written").exists()


@writes_rows
def test_sqlite_acquire_write_then_rollback_in_atomic_leaves_the_key_free(key: str) -> None:
    handle = lock(key, store="sqlite", ttl=300)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        assert handle.acquire()
        Invoice.objects.create(status="rolled-back")
        with within(SQLITE_BUSY_WAIT / 2):
            assert handle.release()
        1 / 0  # noqa: B018
    assert get_lock_store("sqlite").get(key) is None
    assert free(key)
    assert not Invoice.objects.filter(status="rolled-back").exists()


@writes_rows
def test_sqlite_lock_taken_in_atomic_is_held_after_commit_and_undone_by_rollback(
    key: str,
) -> None:
    """A lock taken on the caller's connection is part of the caller's transaction: held
    after it commits (released later, outside, like any lock), gone if it rolls back."""
    kept = lock(key, store="sqlite", ttl=300)
    with transaction.atomic():
        Invoice.objects.create()
        assert kept.acquire()
    assert not free(key)
    assert kept.release()
    assert free(key)

    undone = lock(key, store="sqlite", ttl=300)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        Invoice.objects.create()
        assert undone.acquire()
        1 / 0  # noqa: B018
    assert free(key)


@writes_rows
def test_sqlite_lock_outside_any_transaction_still_uses_the_stores_own_connection(
    key: str,
) -> None:
    """Outside a transaction nothing changes: the lock is committed at once, by the store's
    connection, and another connection sees it held."""
    handle = lock(key, store="sqlite", ttl=60)
    assert handle.acquire()
    assert not free(key)
    assert handle.release()
    assert free(key)


@lock_view("<key>", store="sqlite", ttl=300)
def writes_under_lock(request: HttpRequest, key: str) -> HttpResponse:
    Invoice.objects.create(status=f"view:{key}")
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after writing")
    return HttpResponse("written")


urlpatterns = [path("writes/<path:key>/", writes_under_lock)]


@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.parametrize("fail", [False, True], ids=["commit", "rollback"])
@writes_rows
def test_sqlite_lock_view_under_atomic_requests_frees_the_key(
    key: str, fail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    client = Client(raise_request_exception=False)
    with within(SQLITE_BUSY_WAIT / 2):
        response = client.get(f"/writes/{key}/", {"fail": "1"} if fail else {})
    assert response.status_code == (500 if fail else 200)
    assert Invoice.objects.filter(status=f"view:{key}").exists() is not fail
    assert free(key)


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
    return Lock.objects.using(database).filter(key=key, waiting=True).exists()


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
