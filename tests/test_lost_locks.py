"""A lost lock stops the caller: leaving a block whose lock was lost raises LockNotHeldError
(on_lost="raise", the default), "warn" only logs, a callable decides; an async body kept
alive by the watchdog is cancelled the moment the loss is found.

Locks are lost here the way they are in production: another client force-releases the key
and takes it (a takeover), or the lock expires while the body runs, on every real store.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory

from django_keel_lock import Lock, LockNotHeldError, lock, lock_view, locked, restore_lock
from django_keel_lock.contrib.celery import locked_task
from django_keel_lock.stores import LockStore
from tests.testapp.models import Document

TTL = 0.3  # the watchdog extends every ttl/3


def take_over(store: LockStore, key: str) -> Lock:
    """What another client does to a lock it believes stale: free it, then take it."""
    store.force_release(key)
    thief = lock(key, ttl=30, store=store.alias)
    assert thief.acquire()
    return thief


# -- leaving the block raises -----------------------------------------------------------------
def test_with_block_raises_after_the_body_when_the_lock_was_taken_over(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    finished = []
    with pytest.raises(LockNotHeldError, match="was lost while held") as raised:
        with make_lock(ttl=30) as held:
            thief = take_over(store, key)
            finished.append(True)  # the body is not interrupted: it runs to its end
    assert finished == [True]
    assert f"fence {held.fence}" in str(raised.value)
    assert held.lost and not held.held
    info = store.get(key)
    assert info is not None and info.owner == thief.owner  # the thief's lock is untouched
    assert thief.release()


def test_run_raises_instead_of_reporting_it_ran_under_the_lock(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handle = make_lock(ttl=30)
    with pytest.raises(LockNotHeldError):
        handle.run(lambda: take_over(store, key))
    assert handle.lost and store.get(key) is not None


def test_expiry_while_the_body_runs_raises_too(make_lock: Callable[..., Lock]) -> None:
    with pytest.raises(LockNotHeldError, match="expired or taken over"):
        with make_lock(ttl=0.05):
            time.sleep(0.2)  # the store let the lock expire: release finds it gone


def test_a_clean_release_inside_the_body_is_not_a_loss(make_lock: Callable[..., Lock]) -> None:
    with make_lock(ttl=30) as held:
        assert held.release()
    assert not held.lost and not held.is_expired()


def test_the_bodys_own_error_wins_and_carries_the_loss_as_a_note(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    with pytest.raises(KeyError) as raised:
        with make_lock(ttl=30):
            take_over(store, key)
            raise KeyError("the body's own failure")
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and "was lost while held" in notes[0]


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_the_loss_rolls_back_an_enclosing_atomic_block(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    before = Document.objects.using("postgres").count()
    with pytest.raises(LockNotHeldError):
        with transaction.atomic(using="postgres"), make_lock(ttl=30):
            Document.objects.using("postgres").create(body="charged twice?")
            take_over(store, key)
    assert Document.objects.using("postgres").count() == before


def test_locked_functions_raise_when_their_lock_was_lost(
    store_alias: str, store: LockStore, key: str
) -> None:
    @locked(key, ttl=30, store=store_alias)
    def charge() -> str:
        take_over(store, key)
        return "charged"

    with pytest.raises(LockNotHeldError):
        charge()

    @locked(key + ":warn", ttl=30, store=store_alias, on_lost="warn")
    def charge_anyway() -> str:
        take_over(store, key + ":warn")
        return "charged"

    assert charge_anyway() == "charged"


def test_lock_views_raise_so_the_request_fails_and_atomic_requests_roll_back(
    store_alias: str, store: LockStore, key: str
) -> None:
    @lock_view("<key>", ttl=30, store=store_alias)
    def charge(request: HttpRequest, key: str) -> HttpResponse:
        take_over(store, key)
        return HttpResponse("charged")

    with pytest.raises(LockNotHeldError):
        charge(RequestFactory().post("/charge/"), key=key)


def test_locked_tasks_fail_when_their_lock_was_lost(
    store_alias: str, store: LockStore, key: str
) -> None:
    @locked_task(key, ttl=30, store=store_alias)
    def send_invoice() -> str:
        take_over(store, key)
        return "sent"

    with pytest.raises(LockNotHeldError):
        send_invoice()


# -- on_lost --------------------------------------------------------------------------------
def test_on_lost_warn_keeps_the_old_quiet_exit(
    make_lock: Callable[..., Lock], store: LockStore, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with make_lock(ttl=30, on_lost="warn") as held:
        take_over(store, key)
    assert held.lost
    assert any("was lost" in record.getMessage() for record in caplog.records)


def test_on_lost_callable_is_called_once_at_release_and_the_exit_does_not_raise(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    calls: list[Lock] = []
    with make_lock(ttl=30, on_lost=calls.append) as held:
        take_over(store, key)
        assert calls == []  # nobody has looked yet
    assert calls == [held]
    assert held.release() is False and held.is_expired()
    assert calls == [held]  # once


def test_on_lost_callable_is_called_from_the_watchdog_the_moment_it_finds_the_loss(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    seen = threading.Event()
    threads: list[str] = []

    def stop_the_work(handle: Lock) -> None:
        threads.append(threading.current_thread().name)
        seen.set()

    with make_lock(ttl=TTL, auto_extend=True, on_lost=stop_the_work) as held:
        take_over(store, key)
        assert seen.wait(5 * TTL), "the watchdog did not report the loss"
        assert threads[0].startswith("keel-lock-watchdog")
        assert not held.held
    assert len(threads) == 1


@pytest.mark.parametrize("bad", ["ignore", 0, None, "RAISE"])
def test_on_lost_must_be_raise_warn_or_a_callable(bad: object) -> None:
    with pytest.raises(ValueError, match="on_lost must be"):
        lock("k", store="memory", on_lost=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_lost must be"):
        locked("k", store="memory", on_lost=bad)  # type: ignore[call-overload]


# -- async bodies ---------------------------------------------------------------------------
async def test_async_body_is_cancelled_when_the_watchdog_finds_the_lock_lost(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    reached_the_end = False
    started = time.monotonic()
    with pytest.raises(LockNotHeldError, match="was lost while held"):
        async with make_lock(ttl=TTL, auto_extend=True):
            await asyncio.to_thread(take_over, store, key)
            await asyncio.sleep(30)
            reached_the_end = True
    assert not reached_the_end
    assert time.monotonic() - started < 10 * TTL
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_arun_body_is_cancelled_too(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    async def work() -> str:
        await asyncio.to_thread(take_over, store, key)
        await asyncio.sleep(30)
        return "done"

    handle = make_lock(ttl=TTL, auto_extend=True)
    with pytest.raises(LockNotHeldError):
        await asyncio.wait_for(handle.arun(work), timeout=10 * TTL)


async def test_a_cancellation_from_elsewhere_stays_a_cancellation(
    make_lock: Callable[..., Lock],
) -> None:
    entered = asyncio.Event()

    async def body() -> None:
        async with make_lock(ttl=TTL, auto_extend=True):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.ensure_future(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_async_body_without_the_watchdog_raises_at_the_end(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    finished = []
    with pytest.raises(LockNotHeldError):
        async with make_lock(ttl=30):
            await asyncio.to_thread(take_over, store, key)
            finished.append(True)
    assert finished == [True]


async def test_async_on_lost_warn_does_not_cancel_the_body(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    async with make_lock(ttl=TTL, auto_extend=True, on_lost="warn") as held:
        await asyncio.to_thread(take_over, store, key)
        await asyncio.sleep(4 * TTL)
        assert held.lost


# -- what a handle knows about itself -------------------------------------------------------
def test_a_handle_whose_lock_expired_may_acquire_again(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock(ttl=0.05)
    assert handle.acquire()
    first = handle.fence
    time.sleep(0.15)
    assert not handle.held
    assert handle.acquire()
    assert handle.fence is not None and first is not None and handle.fence > first
    assert handle.release()


def test_is_expired_is_false_after_a_clean_release(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock(ttl=30)
    assert not handle.is_expired()
    assert handle.acquire()
    assert not handle.is_expired()
    assert handle.release()
    assert not handle.is_expired()


def test_is_owned_asks_the_store(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handle = make_lock(ttl=30, on_lost="warn")
    assert not handle.is_owned()  # nothing acquired yet
    assert handle.acquire()
    assert handle.is_owned()
    store.force_release(key)  # what a restarted store without persistence does
    handle.ensure_held()  # the local check cannot know...
    assert not handle.is_owned()  # ...the store can
    assert handle.lost and handle.is_expired()
    with pytest.raises(LockNotHeldError):
        handle.ensure_held()


async def test_ais_owned_asks_the_store(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handle = make_lock(ttl=30, on_lost="warn")
    assert await handle.aacquire()
    assert await handle.ais_owned()
    await asyncio.to_thread(take_over, store, key)
    assert not await handle.ais_owned() and handle.lost


def test_a_restored_handle_notices_its_ttl_ran_out(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handle = make_lock(ttl=0.3)
    assert handle.acquire()
    restored = restore_lock(handle.serialize())
    assert restored.held
    restored.ensure_held()
    time.sleep(0.4)
    thief = make_lock(ttl=30)
    assert thief.acquire()
    assert not restored.held
    with pytest.raises(LockNotHeldError):
        restored.ensure_held()
    assert thief.release()


def test_a_restored_handle_keeps_what_was_left_not_a_whole_ttl(
    make_lock: Callable[..., Lock],
) -> None:
    handle = make_lock(ttl=1.0)
    assert handle.acquire()
    time.sleep(0.6)
    restored = restore_lock(handle.serialize())
    time.sleep(0.5)  # 1.1 s after the acquire: a whole ttl from the restore would still hold
    assert not restored.held
    restored.release()


def test_a_restored_handle_that_extends_holds_on(make_lock: Callable[..., Lock]) -> None:
    handle = make_lock(ttl=0.3)
    assert handle.acquire()
    restored = restore_lock(handle.serialize())
    restored.extend(30)
    time.sleep(0.4)
    assert restored.held and restored.is_owned()
    assert restored.release()
