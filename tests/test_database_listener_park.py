"""PostgreSQL's release listener listens to nothing while its process waits for no key:
PostgreSQL wakes every backend of the database that listens to anything at each NOTIFY, so an
idle process's listener would cost every contended release elsewhere a backend's wake."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_keel_lock import get_lock_store, lock
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.dialects.postgresql import (
    LISTENER_LOCK,
    address_channel,
    grant_channel,
)
from django_keel_lock.stores.database.listener import PostgresListener

from .conftest import needs_store
from .test_database_faults import wait_until
from .test_database_line import postgres_connection

pytestmark = needs_store("postgres")


@pytest.fixture
def store() -> Iterator[DatabaseLockStore]:
    store = DatabaseLockStore("pg-park", {"DATABASE": "postgres"})
    try:
        yield store
    finally:
        store.close()


def _claimed(raw: Any, pid: int) -> bool:
    """Whether the backend `pid` holds a listener's advisory lock (a release carries grants
    to the places that name it only then)."""
    return holds_advisory(raw, LISTENER_LOCK, pid)


def holds_advisory(raw: Any, number: int, pid: int | None) -> bool:
    """Whether the backend `pid` holds the advisory lock (`number`, `pid`)."""
    (count,) = raw.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
        "AND objid = %s AND pid = %s AND granted",
        (number, pid, pid),
    ).fetchone()
    return bool(count)


def _heard_by(listener: PostgresListener) -> list[str]:
    """The channels of the notifications `listener` hears from now on (its `_heard` kept as
    it is, each call noted)."""
    heard: list[str] = []
    real = listener._heard

    def noting(channel: str, payload: str) -> None:
        heard.append(channel)
        real(channel, payload)

    listener._heard = noting  # type: ignore[method-assign]
    return heard


def test_postgres_listener_listens_to_nothing_while_no_key_is_watched(
    store: DatabaseLockStore, key: str
) -> None:
    with store.watch(key):
        listener = store._listener
        assert isinstance(listener, PostgresListener)
        assert wait_until(lambda: key in listener.subscribed and not listener.parked, 10)
        pid = listener.backend_pid
        assert pid is not None
        heard = _heard_by(listener)
        with postgres_connection() as raw:
            assert _claimed(raw, pid)
            raw.execute("SELECT pg_notify(%s, %s)", (address_channel(listener.address), key))
            assert wait_until(lambda: address_channel(listener.address) in heard, 5)
    # Its last key lingers a moment (`linger`), then it is unsubscribed: the listener parks.
    assert wait_until(lambda: listener.parked and not listener.subscribed, 10)
    heard.clear()
    with postgres_connection() as raw:
        assert not _claimed(raw, pid)  # let go: no release carries a grant to it
        for channel in (address_channel(listener.address), grant_channel(listener.address)):
            raw.execute("SELECT pg_notify(%s, %s)", (channel, key))
        # Nothing reaches it.
        time.sleep(0.5)
        assert heard == []
        # Watched again, it listens again, and holds the lock once it does.
        with store.watch(key):
            assert wait_until(lambda: key in listener.subscribed and not listener.parked, 10)
            assert listener.backend_pid == pid  # the same connection, parked and back
            assert _claimed(raw, pid)
            raw.execute("SELECT pg_notify(%s, %s)", (address_channel(listener.address), key))
            assert wait_until(lambda: address_channel(listener.address) in heard, 5)


def test_postgres_waiter_of_a_parked_listener_still_gets_the_lock_handed_over(key: str) -> None:
    """The first waiter of a process whose listener was parked: its place may be written
    before the listener listens again (a release then hands it the short grant and a
    wake-up that may be lost); the subscription's own wake makes it ask, and it takes the
    lock up at once: sooner than a waiter in line asks again by itself (every second)."""
    store = get_lock_store("postgres")
    assert isinstance(store, DatabaseLockStore)
    with store.watch(key + ":before"):  # the listener connected, then parked
        listener = store._listener
        assert isinstance(listener, PostgresListener)
        assert wait_until(lambda: key + ":before" in listener.subscribed, 10)
    assert wait_until(lambda: listener.parked, 10)
    other = DatabaseLockStore("pg-park-holder", {"DATABASE": "postgres"})
    try:
        assert other.acquire(key, "holder", "h", 30).acquired
        got: list[bool] = []
        handle = lock(key, ttl=30, store="postgres")
        waiter = threading.Thread(target=lambda: got.append(handle.acquire(timeout=10)))
        began = time.monotonic()
        waiter.start()
        time.sleep(0.05)  # in line, its listener maybe still parked
        assert other.release(key, "holder")
        waiter.join(15)
        assert got == [True] and time.monotonic() - began < 0.9
        assert handle.release()
    finally:
        other.close()
