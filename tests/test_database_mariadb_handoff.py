"""Edges of MariaDB's direct hand-off (`MariaDB._hand_over`): a KILL carries no grant, so the
listener of the waiter's process reads its grants once woken (`MariaDBListener._read_grants`),
and only those made for the waiter's whole ttl while that listener held its wake address. The
hand-off itself (order, fences, dead and departing waiters) is tests/test_handoff.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.models import Waiter
from django_keel_lock.registry import get_lock_store
from django_keel_lock.stores.base import QUEUE_LEASE
from django_keel_lock.stores.database import DatabaseLockStore
from django_keel_lock.stores.database.dialects.mysql import MySQLDialect

from .conftest import needs_store
from .test_database_faults import behind_proxy, timed, wait_until

pytestmark = needs_store("mariadb")


@contextmanager
def _store(name: str, listen: bool) -> Iterator[DatabaseLockStore]:
    """A MariaDB store of its own (as another process's), its listener connected if
    `listen` (its waiters' places then name it), closed at the end."""
    store = get_lock_store("mariadb")
    assert isinstance(store, DatabaseLockStore)
    other = DatabaseLockStore(f"mariadb-{name}", store.options)
    try:
        if listen:
            other.ensure_listener()
            assert wait_until(other.listener_ready, 10), "the listener never connected"
        yield other
    finally:
        other.close()


@pytest.fixture
def heard() -> Iterator[DatabaseLockStore]:
    with _store("heard", listen=True) as store:
        yield store


@pytest.fixture
def unheard() -> Iterator[DatabaseLockStore]:
    with _store("unheard", listen=False) as store:
        yield store


def test_mariadb_a_grant_made_while_the_listener_was_away_is_short_and_not_read_as_carried(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str
) -> None:
    # The waiter's place names a listener connection that no longer holds its wake address
    # (its listener reconnected since its last attempt): the release grants it only what is
    # left of its place, and the listener, KILLed all the same (it holds the address now),
    # must not hand the waiter that short grant as one for its whole ttl.
    owner = "b" * 32
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    with heard.watch(key, owner) as waiter:
        refused = heard.acquire_queued(key, owner, "holder-bbbb", 30)
        assert not refused.acquired and refused.last_fence is not None
        Waiter.objects.using("mariadb").filter(key=key, owner=owner).update(listener=1)
        assert unheard.release(key, "a" * 32)
        granted = unheard.get(key)
        assert granted is not None and granted.owner == owner
        assert granted.fence > refused.last_fence
        assert granted.expires_in <= QUEUE_LEASE
        waiter.wait(1)  # the KILL's wake-up: the listener has read by now, or reads soon
        time.sleep(0.3)
        assert heard.wake_board.granted(key, owner) is None
    taken = heard.acquire_queued(key, owner, "holder-bbbb", 30)
    assert taken.fence == granted.fence  # taken up by a call, at its whole ttl
    info = unheard.get(key)
    assert info is not None and info.expires_in > QUEUE_LEASE
    assert heard.release(key, owner)


def test_mariadb_a_release_hands_a_waiter_of_its_own_process_the_grant_on_the_board(
    heard: DatabaseLockStore, key: str
) -> None:
    # The releaser does not KILL its own listener: it puts the grant on the board itself.
    owner = "b" * 32
    assert heard.acquire(key, "a" * 32, "holder", 30).acquired
    with heard.watch(key, owner):
        assert not heard.acquire_queued(key, owner, "holder-bbbb", 30).acquired
        assert heard.release(key, "a" * 32)
        info = heard.get(key)
        assert info is not None and info.owner == owner and info.expires_in > QUEUE_LEASE
        assert heard.wake_board.take_grant(key, owner) == info.fence
    assert heard.release(key, owner)
    assert heard.get(key) is None


def test_mariadb_a_release_with_nobody_in_line_frees_the_lock_though_the_flag_is_up(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str
) -> None:
    # A waiter outside the line raised the flag (a plain acquire's refusal): nothing to hand
    # over, so the lock is free, and whoever waits takes it.
    assert heard.acquire(key, "a" * 32, "holder", 30).acquired
    assert not unheard.acquire(key, "c" * 32, "plain", 30).acquired
    assert heard.release(key, "a" * 32)
    assert heard.get(key) is None
    assert unheard.acquire(key, "c" * 32, "plain", 30).acquired
    assert unheard.release(key, "c" * 32)


@contextmanager
def _handing_over(key: str, owner: str, waiter: str, listener: int) -> Iterator[tuple[Any, int]]:
    """A release of `key` by `owner` as `MariaDB._handing_over` runs it, on a connection of
    its own, stopped after the KILL of `listener` (the waiter's process's), before its end:
    (the open connection, the fence granted to `waiter`). The caller commits or rolls back."""
    dialect = MySQLDialect()
    base = connections["mariadb"]
    raw = base.get_new_connection(base.get_connection_params())
    try:
        raw.autocommit(True)
        cursor = raw.cursor()
        cursor.execute("BEGIN")
        cursor.execute(dialect.hand_over_sql, (owner, None, None, owner, key))
        row = cursor.fetchone()
        assert row[0] and row[3] == waiter, row
        place, holder, ttl, fence = row[2], row[4], row[5], row[9]
        grant = (waiter, holder, fence, dialect.interval(ttl), fence, key, place)
        cursor.execute(dialect.grant_sql, grant)
        cursor.execute(dialect.kill_sql, (listener,))
        yield raw, int(fence)
    finally:
        raw.close()


@contextmanager
def _waiting_behind(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str, owner: str
) -> Iterator[tuple[Any, int]]:
    """`key` held by "a" * 32 through `unheard`, and `owner` refused it in line through
    `heard`, watching it: (its waiter, the connection id of `heard`'s listener)."""
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    with heard.watch(key, owner) as waiter:
        assert not heard.acquire_queued(key, owner, "holder-bbbb", 30).acquired
        listener = heard.release_listener
        assert listener is not None and listener.connection_id
        yield waiter, int(listener.connection_id)


def test_mariadb_a_grant_whose_release_rolled_back_after_the_kill_is_never_taken(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str
) -> None:
    # The release KILLs the waiter's listener before its COMMIT, then rolls back (a
    # deadlock, a lost connection): the listener, woken, must not read the grant that never
    # was, and the waiter is not stranded: the lock is still the releaser's, and its real
    # release hands it over.
    owner = "b" * 32
    with _waiting_behind(heard, unheard, key, owner) as (_, listener):
        with _handing_over(key, "a" * 32, owner, listener) as (raw, fence):
            time.sleep(0.3)  # the listener is woken, and waits for the row
            raw.cursor().execute("ROLLBACK")
        time.sleep(0.3)  # its read of the grants is over
        assert heard.wake_board.granted(key, owner) is None
        info = unheard.get(key)
        assert info is not None and info.owner == "a" * 32
        assert unheard.release(key, "a" * 32)
        assert wait_until(lambda: heard.wake_board.granted(key, owner) is not None, 5)
        handed = heard.wake_board.take_grant(key, owner)
        assert handed is not None and handed > fence
    info = unheard.get(key)
    assert info is not None and info.owner == owner and info.fence == handed
    assert heard.release(key, owner)


def test_mariadb_a_waiter_whose_listener_gave_up_waiting_for_the_commit_takes_its_grant_then(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str
) -> None:
    # The release holds the row past the listener's second (1205): the listener gives the
    # read up and wakes its waiters, whose next attempt waits for the COMMIT and takes the
    # grant up at its fence.
    with _waiting_behind(heard, unheard, key, "b" * 32) as (waiter, listener):
        handing_over = _handing_over(key, "a" * 32, "b" * 32, listener)
        with handing_over as (raw, fence):
            started = time.monotonic()
            waiter.wait(2.5)  # woken once the listener gave its read up
            woken = time.monotonic() - started
            time.sleep(max(0.0, 1.5 - woken))
            committed = time.monotonic()
            raw.cursor().execute("COMMIT")
        assert woken < QUEUE_LEASE, woken
        taken = heard.acquire_queued(key, "b" * 32, "holder-bbbb", 30)
        assert time.monotonic() - committed < 1
    assert taken.fence == fence
    assert heard.release(key, "b" * 32)


def test_mariadb_a_hand_over_stalled_before_its_commit_strands_the_lock_no_longer_than_its_ttl(
    heard: DatabaseLockStore, unheard: DatabaseLockStore, key: str
) -> None:
    # The link to the server stalls (nothing closed) once the hand-over has sent its KILL:
    # the releaser hears LockStoreUnavailable within its SOCKET_TIMEOUT, and the server keeps
    # the transaction open, its lock row locked. The lock must be free to take by its ttl
    # (plus the server's idle_transaction_timeout, the store's SOCKET_TIMEOUT), not only
    # once the server notices the connection is gone (wait_timeout: hours).
    owner = "b" * 32
    with behind_proxy("mariadb", SOCKET_TIMEOUT=2) as (proxied, proxy):
        assert proxied.acquire(key, "a" * 32, "holder", 2).acquired
        taken_at = time.monotonic()
        with heard.watch(key, owner):
            assert not heard.acquire_queued(key, owner, "holder-bbbb", 30).acquired
            proxy.silent, proxy.stall_on = True, b"KILL QUERY"
            with pytest.raises(LockStoreUnavailable):
                proxied.release(key, "a" * 32)
            assert proxy.mode == "stall"
            time.sleep(max(0.0, taken_at + 2 + 2 - time.monotonic()))
            taken, took = timed(lambda: unheard.acquire(key, "c" * 32, "holder-cccc", 30))
            assert not isinstance(taken, BaseException), (taken, took)
            assert taken.acquired and took < 1.5, (taken, took)
        proxy.drop_connections()
        assert unheard.release(key, "c" * 32)


def _refused_outside_and_released(
    store: DatabaseLockStore, proxy: Any, unheard: DatabaseLockStore, key: str
) -> list[int]:
    """Three times: `key` taken through `store`, refused to a plain acquire of `unheard`
    (the flag raised, nobody in line), released: the round trips of each release."""
    counts = []
    for _ in range(3):
        assert store.acquire(key, "a" * 32, "holder", 30).acquired
        assert not unheard.acquire(key, "c" * 32, "plain", 30).acquired
        before = proxy.trips
        assert store.release(key, "a" * 32)
        counts.append(proxy.trips - before)
        assert store.get(key) is None
    return counts


def test_mariadb_a_release_after_a_refusal_outside_the_line_costs_two_round_trips(
    unheard: DatabaseLockStore, key: str
) -> None:
    # A caller that does not wait in line (a plain acquire) raises the flag; nobody stands in
    # the line. The release frees the lock and rings the doorbell: the one statement that
    # frees it unless a live waiter stands in line, then the ring (as before hand-offs), once
    # the process has seen the key so (the first such release also tries the statement that
    # frees only while the flag is down). A release by an owner that no longer holds the
    # lock costs no transaction either.
    with behind_proxy("mariadb") as (store, proxy):
        counts = _refused_outside_and_released(store, proxy, unheard, key)
        assert counts[0] <= 3 and counts[1:] == [2, 2], counts
        before = proxy.trips
        assert not store.release(key, "a" * 32)
        assert proxy.trips - before <= 2


def test_mariadb_a_key_whose_line_emptied_is_released_in_two_round_trips_again(
    unheard: DatabaseLockStore, key: str
) -> None:
    # A release here handed the key over (its next goes straight to the hand-over); then
    # only callers outside the line are refused it: the release after the one that found
    # nobody in line is two round trips again (nobody listens to the key: the ring has no
    # KILL to send), and a waiter that joins later is handed the lock all the same.
    owner = "b" * 32
    with behind_proxy("mariadb") as (store, proxy):
        assert store.acquire(key, "a" * 32, "holder", 30).acquired
        with _store("gone", listen=True) as heard, heard.watch(key, owner):
            assert not heard.acquire_queued(key, owner, "holder-bbbb", 30).acquired
            assert store.release(key, "a" * 32)
            assert heard.release(key, owner)
        counts = _refused_outside_and_released(store, proxy, unheard, key)
        assert counts[1:] == [2, 2], counts
        assert store.acquire(key, "a" * 32, "holder", 30).acquired
        with _store("later", listen=True) as heard, heard.watch(key, owner):
            assert not heard.acquire_queued(key, owner, "holder-bbbb", 30).acquired
            assert store.release(key, "a" * 32)
            info = store.get(key)
            assert info is not None and info.owner == owner
            assert heard.release(key, owner)
