"""Edges of the PostgreSQL direct hand-off (migration 0009's release function, the grant
carried in its NOTIFY): what a waiter that took a carried grant with no call leaves behind.
The hand-off itself is tests/test_handoff.py's and tests/test_database_line.py's."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import pytest

from django_keel_lock import Lock, lock
from django_keel_lock.idempotency.storage import keep_releasing
from django_keel_lock.models import Lock as LockRow
from django_keel_lock.models import Waiter
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.results import DatabaseResults
from django_keel_lock.stores.results import StoredResult

from .test_database_faults import wait_until
from .test_database_line import database_store_of, listening_at


def _stands_listening(key: str) -> bool:
    """Whether `key`'s line has a place whose process listens (a release carries it the
    grant)."""
    places = Waiter.objects.using("postgres").filter(key=key, listener__isnull=False)
    return places.exists()


def _handed_to_a_waiter(key: str) -> tuple[Lock, bool]:
    """A handle that waited for `key` and was handed it by a release; whether it took the
    grant the release carried to it with no call (its place is then still there, marked with
    the fence it holds: a take-up by a call deletes it), which it does unless its refreshing
    attempt was under way at the release."""
    holder = lock(key, ttl=30, store="postgres")
    assert holder.acquire()
    waiter = lock(key, ttl=30, store="postgres")
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=20)))
    thread.start()
    try:
        assert wait_until(lambda: _stands_listening(key), 15), "never stood listening"
        holder.release()
    finally:
        thread.join(20)
    assert got == [True]
    places = Waiter.objects.using("postgres").filter(key=key, owner=waiter.owner)
    return waiter, places.filter(fence=waiter.fence).exists()


def _plain(handle: Lock) -> None:
    assert handle.release()


def _keeping_a_result(handle: Lock) -> None:
    assert handle.fence is not None
    result = StoredResult(handle.key, "f" * 64, handle.fence, 200, b"done")
    assert keep_releasing(handle, DatabaseResults(database_store_of("postgres")), result, 60)


@pytest.mark.parametrize("release", [_plain, _keeping_a_result], ids=["plain", "keeping"])
def test_postgres_a_carried_grant_taken_with_no_call_is_forgotten_by_the_store_on_release(
    key: str, release: Callable[[Lock], None]
) -> None:
    """The store remembers which (key, owner) stand in a line, so that `leave_queue` knows
    whom to take out; a waiter that takes a carried grant makes no call, so the store is
    not told it left. Its release says so: a process that keeps handing locks over does not
    keep one entry per hand-off for ever."""
    store = database_store_of("postgres")
    for attempt in range(5):  # until one grant is taken with no call
        waiter, carried = _handed_to_a_waiter(f"{key}:{attempt}")
        owner = waiter.owner
        release(waiter)
        if carried:
            break
    assert carried, "no grant was taken with no call"
    assert (waiter.key, owner) not in store._in_line


def _handed_to_a_deaf_first(store: DatabaseLockStore, key: str) -> None:
    """`key` held by "holder", "first" (at a deaf address) and "next" (at "beef") in its
    line with no listener, then released: handed over to "first" with a short grant."""
    assert store.acquire(key, "holder", "h", 30).acquired
    for owner, address in (("first", "dead"), ("next", "beef")):
        assert not store.acquire_queued(key, owner, owner, 30).acquired
        places = Waiter.objects.using("postgres").filter(key=key, owner=owner)
        assert places.update(address=address, listener=None)
    assert store.release(key, "holder")


def test_postgres_leaving_the_line_with_a_grant_that_lapsed_wakes_the_next_in_it(
    key: str,
) -> None:
    """A grant not carried lives no longer than its waiter's place: one that leaves the line
    after it lapsed has nothing to pass on, and the lock is free; the next in line is woken
    to take it, as when a waiter with no grant leaves (not left to find out at its next
    poll)."""
    store = database_store_of("postgres")
    with listening_at("beef") as raw:
        _handed_to_a_deaf_first(store, key)
        assert list(raw.notifies(timeout=0.3)) == []
        lapsed = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
        assert LockRow.objects.using("postgres").filter(key=key).update(expires_at=lapsed)
        store.leave_queue(key, "first")
        assert [n.payload for n in raw.notifies(timeout=0.3)] == [key]
        store.leave_queue(key, "next")


def test_postgres_a_release_that_only_wakes_skips_the_releasers_own_marked_place(
    key: str,
) -> None:
    """A waiter handed the lock keeps its place, marked with the grant's fence, until it
    releases (one that took a carried grant made no call). A release of it that only wakes
    the first in line (several keys at once, an idempotent result's) must wake the next
    waiter's process, not the releaser's own place."""
    store = database_store_of("postgres")
    with listening_at("beef") as raw:
        _handed_to_a_deaf_first(store, key)
        held = store.get(key)
        assert held is not None and held.owner == "first"
        assert list(raw.notifies(timeout=0.3)) == []
        assert store.release_many((key,), "first")  # wakes, hands nothing over
        assert [n.payload for n in raw.notifies(timeout=0.5)] == [key]
        store.leave_queue(key, "next")
