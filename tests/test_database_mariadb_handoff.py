"""Edges of MariaDB's direct hand-off (`MariaDB._hand_over`): a KILL carries no grant, so the
listener of the waiter's process reads its grants once woken (`MariaDBListener._read_grants`),
and only those made for the waiter's whole ttl while that listener held its wake address. The
hand-off itself (order, fences, dead and departing waiters) is tests/test_handoff.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from django_keel_lock.models import Waiter
from django_keel_lock.registry import get_lock_store
from django_keel_lock.stores.base import QUEUE_LEASE
from django_keel_lock.stores.database import DatabaseLockStore

from .conftest import needs_store
from .test_database_faults import wait_until

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
