"""The async API: `async with`, arun, aacquire & co. on every store, and cancellation safety.

Cancellation is tested at every point where the lock's coroutines suspend: `Stepper` counts
the suspensions of a scenario and cancels the task at the k-th one, for every k.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import pytest
from django.db import connections

from django_keel_lock import (
    Lock,
    LockError,
    LockNotHeldError,
    LockUnavailable,
    lock,
    set_lock_store,
    signals,
)
from django_keel_lock.stores import LockStore
from django_keel_lock.stores.database import DatabaseLockStore

from .conftest import store_params
from .support import ROOT

SHARED_STORES = store_params(["sqlite", "postgres", "redis"])


class Stepper:
    """Awaits a coroutine, counting its suspensions; cancels its own task at the
    `cancel_at`-th one (and again at each of `also_at`), so the CancelledError lands exactly
    at that await point."""

    def __init__(self, coro: Coroutine[Any, Any, Any], cancel_at: int, *also_at: int) -> None:
        self.coro = coro
        self.cancel_at = {cancel_at, *also_at}
        self.suspensions = 0
        self.cancelled_at: list[int] = []

    def __await__(self) -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self.coro.throw(error) if error is not None else self.coro.send(value)
            except StopIteration as stop:
                return stop.value
            self.suspensions += 1
            if self.suspensions in self.cancel_at:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # applied to the future we are about to wait on
                self.cancelled_at.append(self.suspensions)
            try:
                value, error = (yield yielded), None
            except BaseException as exc:
                value, error = None, exc


async def step(stepper: Stepper) -> Any:
    return await stepper


def release_counter(store: LockStore, key: str) -> tuple[list[float], Callable[[], None]]:
    """Record each wake-up of `key`'s waiters: every release, and any wake the store adds
    (a listener wakes a key's waiters once when it starts hearing that key's releases)."""
    seen: list[float] = []
    token = store.wake_board.add_callback(key, lambda: seen.append(time.monotonic()))
    return seen, lambda: store.wake_board.remove_callback(token)


# -- the API on every store ---------------------------------------------------------------


async def test_async_with_holds_then_releases_and_raises_when_held(
    make_lock: Callable[..., Lock],
) -> None:
    async with make_lock(ttl=30) as handle:
        assert handle.held and handle.fence is not None
        assert await handle.ais_locked()
        remaining = await handle.aremaining_time()
        assert remaining is not None and 29 < remaining <= 30.01
        info = await handle.ainfo()
        assert info is not None and info.owner == handle.owner and info.fence == handle.fence
        with pytest.raises(LockUnavailable) as caught:
            async with make_lock(timeout=0.2):
                pytest.fail("the body ran without the lock")
        assert caught.value.key == handle.key
        handle.ensure_held()
    assert not handle.held
    assert not await handle.ais_locked()
    assert await handle.aremaining_time() is None and await handle.ainfo() is None
    with pytest.raises(LockNotHeldError):
        handle.ensure_held()


async def test_aacquire_arelease_aextend_match_the_sync_semantics(
    make_lock: Callable[..., Lock],
) -> None:
    handle = make_lock(ttl=0.5)
    assert await handle.aacquire()
    with pytest.raises(LockError, match="already holds"):
        await handle.aacquire()
    assert not await make_lock().aacquire()
    await handle.aextend(10)
    remaining = await handle.aremaining_time()
    assert remaining is not None and 9 < remaining <= 10.01
    assert not await handle.ais_expired()
    assert await handle.arelease() is True
    assert await handle.arelease() is False
    with pytest.raises(LockNotHeldError, match="does not hold"):
        await handle.aextend()

    stale = make_lock(ttl=0.2)
    assert await stale.aacquire()
    await asyncio.sleep(0.35)
    fresh = make_lock(ttl=10)
    assert await fresh.aacquire()
    lost: list[str] = []

    def on_lost(sender: Any, lock: Lock, reason: str, **kwargs: Any) -> None:
        lost.append(reason)

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockNotHeldError, match="expired or was taken over"):
            await stale.aextend()
        assert await stale.ais_expired()  # it knows already: no second lock_lost
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert not stale.held and stale.lost and len(lost) == 1
    assert await stale.arelease() is False
    assert fresh.fence is not None and stale.fence is not None and fresh.fence > stale.fence
    assert await fresh.arelease()


async def test_arun_runs_async_and_sync_callables_and_always_releases(
    make_lock: Callable[..., Lock],
) -> None:
    handle = make_lock()

    async def build() -> str:
        assert await handle.ais_locked()
        return "async"

    assert await handle.arun(build) == (True, "async")
    main_thread = threading.get_ident()
    threads: list[int] = []

    def build_sync() -> str:
        threads.append(threading.get_ident())
        return "sync"

    assert await handle.arun(build_sync) == (True, "sync")
    assert threads and threads[0] != main_thread  # ran in a worker thread, not on the loop
    assert await handle.arun(lambda: build()) == (True, "async")  # sync callable -> awaitable

    blocker = make_lock()
    assert await blocker.aacquire()
    calls: list[int] = []

    async def record() -> None:
        calls.append(1)

    assert await make_lock().arun(record, timeout=0.1) == (False, None)
    assert calls == []
    assert await blocker.arelease()

    async def boom() -> None:
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        await handle.arun(boom)
    assert not await handle.ais_locked()


async def test_waiting_does_not_block_the_event_loop_and_wakes_on_release(
    make_lock: Callable[..., Lock],
) -> None:
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def release_later() -> None:
        await asyncio.sleep(0.4)
        await holder.arelease()

    ticking = asyncio.create_task(ticker())
    releasing = asyncio.create_task(release_later())
    started = time.monotonic()
    waiter = make_lock()
    assert await waiter.aacquire(timeout=10, retry_delay=5)  # no polling: a wake-up or expiry
    waited = time.monotonic() - started
    ticking.cancel()
    await releasing
    assert 0.35 < waited < 3.0
    assert ticks >= 10  # the loop kept running while we waited (blocking it gives ~0)
    assert await waiter.arelease()


async def test_wait_gives_up_at_the_deadline(make_lock: Callable[..., Lock]) -> None:
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    started = time.monotonic()
    assert not await make_lock().aacquire(timeout=0.3, retry_delay=0.05)
    assert 0.3 <= time.monotonic() - started < 1.5
    assert await holder.arelease()


async def test_waiter_takes_over_an_expired_holder(make_lock: Callable[..., Lock]) -> None:
    holder = make_lock(ttl=0.3)
    assert await holder.aacquire()
    waiter = make_lock()
    started = time.monotonic()
    assert await waiter.aacquire(timeout=5)
    assert time.monotonic() - started < 2.0
    assert waiter.fence is not None and holder.fence is not None and waiter.fence > holder.fence
    assert await waiter.arelease()


async def test_200_tasks_on_one_key_in_one_loop_never_overlap(
    make_lock: Callable[..., Lock],
) -> None:
    inside = 0
    entries: list[int] = []

    async def worker() -> None:
        nonlocal inside
        async with make_lock(ttl=30, timeout=60) as handle:
            inside += 1
            assert inside == 1, "two tasks inside the lock"
            assert handle.fence is not None
            entries.append(handle.fence)
            await asyncio.sleep(0)  # let every other task try to get in meanwhile
            inside -= 1

    await asyncio.gather(*(worker() for _ in range(200)))
    assert len(entries) == 200
    assert entries == sorted(entries) and len(set(entries)) == 200


CHILD = """
import asyncio, json, sys, time
from tests.support.child import setup_django
setup_django()
from django_keel_lock import lock

store, key, tasks, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

async def worker():
    async with lock(key, store=store, ttl=30, timeout=60) as handle:
        entered = time.monotonic()
        await asyncio.sleep(0.002)
        return handle.fence, entered, time.monotonic()

async def main():
    await asyncio.sleep(max(0.0, start_at - time.time()))
    return await asyncio.gather(*(worker() for _ in range(tasks)))

print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.parametrize("alias", SHARED_STORES)
async def test_tasks_in_several_processes_never_overlap(alias: str, key: str) -> None:
    start_at = time.time() + 4.0  # all processes start together, once Django is set up
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, alias, key, "20", str(start_at)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def worker() -> tuple[int, float, float]:
            async with lock(key, store=alias, ttl=30, timeout=60) as handle:
                entered = time.monotonic()
                await asyncio.sleep(0.002)
                assert handle.fence is not None
                return handle.fence, entered, time.monotonic()

        mine = await asyncio.gather(*(worker() for _ in range(20)))
        outputs = [await asyncio.to_thread(child.communicate, timeout=60) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    intervals = [tuple(item) for out, _ in outputs for item in json.loads(out)] + mine
    assert len(intervals) == 80
    intervals.sort(key=lambda item: item[1])  # CLOCK_MONOTONIC is shared by all processes
    for before, after in itertools.pairwise(intervals):
        assert after[1] >= before[2], f"overlap: {before} and {after}"
        assert after[0] > before[0], "fences must grow in the order holders got in"


# -- cancellation at every await point ---------------------------------------------------


async def _sweep(
    scenario: Callable[[int], Awaitable[tuple[Stepper, Lock]]],
    check: Callable[[Stepper, Lock], Awaitable[None]],
) -> int:
    """Run `scenario(k)` cancelling at suspension k = 1, 2, ... until it finishes without
    reaching k; `check` the invariants after each. The number of points covered."""
    for k in range(1, 60):
        stepper, handle = await scenario(k)
        assert stepper.cancelled_at == [k] or not stepper.cancelled_at
        await check(stepper, handle)
        if not stepper.cancelled_at:
            assert k > 2, "the scenario should have several await points"
            return k - 1
    raise AssertionError("the scenario never finished")


async def _no_stranded_lock(store: LockStore, key: str, handle: Lock, allowed: str | None) -> None:
    assert not handle.held
    info = await store.aget(key)
    assert info is None or info.owner == allowed, f"stranded lock {info}"


async def test_cancelling_async_with_at_every_await_point_leaves_no_lock(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    """Free lock: attempt in flight, body, release in flight."""
    bodies: list[int] = []

    async def scenario(k: int) -> tuple[Stepper, Lock]:
        handle = make_lock(ttl=30)

        async def use() -> None:
            async with handle:
                bodies.append(k)
                await asyncio.sleep(0)

        stepper = Stepper(use(), k)
        try:
            await asyncio.create_task(step(stepper))
        except asyncio.CancelledError:
            assert stepper.cancelled_at, "cancelled without our cancel"
        else:
            assert not stepper.cancelled_at, "the cancellation was swallowed"
        return stepper, handle

    async def check(stepper: Stepper, handle: Lock) -> None:
        await _no_stranded_lock(store, key, handle, None)

    points = await _sweep(scenario, check)
    assert points >= 3 and len(bodies) >= 2  # the body ran for the later cancellation points


async def test_cancelling_a_waiter_at_every_await_point_leaves_no_lock(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    """Held lock released meanwhile: attempt, wait, wake-up, attempt, body, release."""

    async def scenario(k: int) -> tuple[Stepper, Lock]:
        holder = make_lock(ttl=30)
        assert await holder.aacquire()
        handle = make_lock(ttl=30, timeout=10, retry_delay=5)

        async def use() -> None:
            async with handle:
                await asyncio.sleep(0)

        async def release_soon() -> None:
            await asyncio.sleep(0.05)
            await holder.arelease()

        releasing = asyncio.create_task(release_soon())
        stepper = Stepper(use(), k)
        try:
            await asyncio.create_task(step(stepper))
        except asyncio.CancelledError:
            assert stepper.cancelled_at
        else:
            assert not stepper.cancelled_at
        await releasing
        return stepper, handle

    async def check(stepper: Stepper, handle: Lock) -> None:
        await _no_stranded_lock(store, key, handle, None)
        other = make_lock()
        assert await other.aacquire()  # free now, not once a ttl of 30 s has run out
        assert await other.arelease()

    assert await _sweep(scenario, check) >= 4


async def test_cancelling_twice_while_settling_still_leaves_no_lock(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    """A second cancel lands while the first is being settled (release of what it took)."""
    for k in (1, 2, 3):
        handle = make_lock(ttl=30)

        async def use(handle: Lock = handle) -> None:
            async with handle:
                await asyncio.sleep(0)

        stepper = Stepper(use(), k, k + 1, k + 2)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(step(stepper))
        await _no_stranded_lock(store, key, handle, None)


async def test_cancelled_in_flight_acquire_gives_back_what_it_took(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    """Cancelled while the acquire round trip is in flight: the store grants the lock, and the
    core releases it before the CancelledError gets out."""
    releases, stop = release_counter(store, key)
    try:
        handle = make_lock(ttl=30)
        stepper = Stepper(handle.aacquire(), 1)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(step(stepper))
        assert stepper.cancelled_at == [1]
        assert not handle.held and handle.fence is None
        assert await store.aget(key) is None  # already free: no waiting for the ttl
        assert releases  # it was taken, then given back (PostgreSQL also hears its NOTIFY)
    finally:
        stop()


async def test_cancelled_queued_waiter_does_not_block_the_others(
    make_lock: Callable[..., Lock],
) -> None:
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    first = asyncio.create_task(make_lock().aacquire(timeout=10))
    second_handle = make_lock()
    second = asyncio.create_task(second_handle.aacquire(timeout=10))
    third_handle = make_lock()
    third = asyncio.create_task(third_handle.aacquire(timeout=10))
    await asyncio.sleep(0.2)
    first.cancel()
    second.cancel()
    await holder.arelease()
    assert await asyncio.wait_for(third, 5)
    assert third_handle.held and not second_handle.held
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await third_handle.arelease()


async def test_timeout_around_aacquire_leaves_no_lock(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    handle = make_lock()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await handle.aacquire(timeout=10)
    await holder.arelease()
    await _no_stranded_lock(store, key, handle, None)


async def test_cancelled_arun_keeps_the_lock_until_a_sync_fn_returns(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    """A thread cannot be interrupted: the lock must cover it until it returns."""
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.5)
        finished.append(time.monotonic())

    releases, stop = release_counter(store, key)
    try:
        handle = make_lock(ttl=30)
        task = asyncio.create_task(handle.arun(slow))
        await asyncio.sleep(0.15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished, "the CancelledError got out while the protected code still ran"
        # The last wake is the release. (A listener may add a harmless early wake when it
        # subscribes to the key; a release before `slow` returned would be the last one.)
        assert releases and releases[-1] >= finished[0]
        await _no_stranded_lock(store, key, handle, None)
    finally:
        stop()


async def test_cancelled_arun_with_async_fn_releases_at_once(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    handle = make_lock(ttl=30)
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(handle.arun(forever))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _no_stranded_lock(store, key, handle, None)


# -- database store under async ----------------------------------------------------------


def _connections_to(alias: str) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


@pytest.mark.parametrize("alias", store_params(["postgres"]))
def test_many_event_loops_reuse_the_store_s_connections(alias: str, key: str) -> None:
    """Each asyncio.run (or async_to_sync) has its own loop and default executor; the store's
    connections must not pile up with them, and close() must free them all."""
    store = DatabaseLockStore(alias="loops", options={"DATABASE": alias})
    set_lock_store(store, "loops")  # a store of its own, so we count only its connections
    before = _connections_to(alias)

    async def once() -> None:
        handle = lock(key, ttl=30, store="loops")
        assert await handle.aacquire()
        assert await handle.ais_locked()
        assert await handle.arelease()

    try:
        for _ in range(20):
            asyncio.run(once())
    finally:
        set_lock_store(None, "loops")
    grown = _connections_to(alias) - before
    assert 1 <= grown <= store.worker_threads, grown
    store.close()
    deadline = time.monotonic() + 5
    while _connections_to(alias) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _connections_to(alias) <= before
