"""Semaphores and shared locks through the public API, on every store that has them.

The same handle as `lock()`: these check what is new (limits, readers and writers, the mix of
modes on one key) and that the old guarantees (fences, ttl, loss, hand-over) hold per permit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from django.views import View

from django_keel_lock import (
    Lock,
    LockNotHeldError,
    LockUnavailable,
    LockViewMixin,
    force_release,
    lock,
    lock_view,
    locked,
    restore_lock,
    semaphore,
)
from django_keel_lock.stores.base import QUEUE_LEASE
from tests.conftest import serving, store_params
from tests.support.third_party_store import DictLockStore

MODAL_STORES = store_params(["memory", "sqlite", "postgres", "mariadb", "redis"])


@pytest.fixture(params=MODAL_STORES)
def store_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sem(store_alias: str, key: str) -> Callable[..., Lock]:
    def make(limit: int = 3, **kwargs: Any) -> Lock:
        kwargs.setdefault("store", store_alias)
        return semaphore(kwargs.pop("name", key), limit=limit, **kwargs)

    return make


@pytest.fixture
def rw(store_alias: str, key: str) -> Callable[..., Lock]:
    def make(shared: bool = False, **kwargs: Any) -> Lock:
        kwargs.setdefault("store", store_alias)
        return lock(key, shared=shared, **kwargs)

    return make


def test_semaphore_admits_limit_holders_then_refuses_until_one_leaves(
    sem: Callable[..., Lock],
) -> None:
    holders = [sem() for _ in range(3)]
    assert all(h.acquire() for h in holders)
    fences = [h.fence for h in holders]
    assert fences == sorted(fences) and len(set(fences)) == 3  # type: ignore[type-var]
    fourth = sem()
    assert not fourth.acquire()
    with pytest.raises(LockUnavailable, match=r"semaphore .* has no free permit \(limit 3"):
        with sem():
            pass
    assert holders[1].release()
    assert fourth.acquire() and fourth.fence > max(fences)  # type: ignore[operator, type-var]
    for handle in (holders[0], holders[2], fourth):
        assert handle.release()
    assert not fourth.is_locked()


def test_run_reports_whether_it_ran_and_the_result(sem: Callable[..., Lock]) -> None:
    others = [sem(limit=2) for _ in range(2)]
    assert all(h.acquire() for h in others)
    assert sem(limit=2).run(lambda: 42) == (False, None)
    assert others[0].release()
    assert sem(limit=2).run(lambda: 42) == (True, 42)


def test_a_waiter_gets_the_permit_released_by_another_thread(sem: Callable[..., Lock]) -> None:
    holders = [sem(limit=2) for _ in range(2)]
    assert all(h.acquire() for h in holders)
    timer = threading.Timer(0.3, holders[0].release)
    timer.start()
    started = time.monotonic()
    waiter = sem(limit=2, timeout=10)
    try:
        assert waiter.acquire()
        assert time.monotonic() - started < 5
    finally:
        timer.join()
    assert waiter.release() and holders[1].release()


def test_at_most_limit_threads_run_at_once_and_limit_is_reached(
    sem: Callable[..., Lock],
) -> None:
    inside, peak, mutex = 0, 0, threading.Lock()
    full = threading.Event()

    def work() -> None:
        nonlocal inside, peak
        for _ in range(3):
            with sem(limit=3, timeout=20, ttl=10):
                with mutex:
                    inside += 1
                    peak = max(peak, inside)
                    if inside == 3:
                        full.set()
                # The first holders stay until three are in, however slowly a loaded machine
                # lets the others in: "the limit is reached" does not hang on timing.
                full.wait(5)
                time.sleep(0.02)
                with mutex:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak == 3


def test_readers_share_and_a_writer_is_alone(rw: Callable[..., Lock]) -> None:
    readers = [rw(shared=True) for _ in range(3)]
    assert all(r.acquire() for r in readers)
    writer = rw()
    assert not writer.acquire()
    for reader in readers:
        assert reader.release()
    assert writer.acquire()
    assert not rw(shared=True).acquire()
    assert writer.release()
    assert rw(shared=True).acquire()


def _until_readers_are_kept_out(rw: Callable[..., Lock]) -> None:
    """Return once a new reader is refused: a waiting writer's mark stands."""
    deadline = time.monotonic() + 5
    late = rw(shared=True)
    while late.acquire():
        assert late.release()
        assert time.monotonic() < deadline, "the writer never kept readers out"
        time.sleep(0.01)


def test_a_waiting_writer_keeps_later_readers_out_and_gets_in_when_readers_leave(
    rw: Callable[..., Lock],
) -> None:
    first = rw(shared=True)
    assert first.acquire()
    writer = rw(timeout=10)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(writer.acquire()))
    thread.start()
    late = rw(shared=True)
    try:
        _until_readers_are_kept_out(rw)
        assert first.release()
        thread.join(5)
        assert got == [True]
        assert not late.acquire()
    finally:
        thread.join()
    assert writer.release()
    assert late.acquire() and late.release()


def test_a_writer_kept_out_by_another_writer_leaves_no_mark_once_it_has_the_lock(
    rw: Callable[..., Lock],
) -> None:
    reader = rw(shared=True, ttl=1)
    assert reader.acquire()
    writer = rw(timeout=10, retry_delay=5)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(writer.acquire() and writer.release()))
    thread.start()
    try:
        _until_readers_are_kept_out(rw)
        # The reader's permit runs out (no release wakes the writer): another writer, asking
        # without a pause, takes the key first, so the waiting one is refused by it.
        other = rw(ttl=30)
        deadline = time.monotonic() + 5
        while not other.acquire():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.3)
        assert other.release()
        thread.join(10)
        assert got == [True]
    finally:
        thread.join()
    # Nobody holds the key or waits for it: a reader gets it at once.
    late = rw(shared=True)
    assert late.acquire() and late.release()


async def test_a_cancelled_writer_keeps_readers_out_for_its_lease_at_most(
    rw: Callable[..., Lock],
) -> None:
    reader = rw(shared=True)
    assert await reader.aacquire()
    writer = rw(timeout=30)
    task = asyncio.ensure_future(writer.aacquire())
    try:
        await asyncio.to_thread(_until_readers_are_kept_out, rw)
    finally:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await reader.arelease()
    late = rw(shared=True)
    assert await late.aacquire(timeout=QUEUE_LEASE + 1)
    assert await late.arelease()


def test_one_key_as_semaphore_and_lock_at_once_is_a_value_error(
    sem: Callable[..., Lock], rw: Callable[..., Lock]
) -> None:
    permit = sem()
    assert permit.acquire()
    with pytest.raises(ValueError, match="held as a semaphore and cannot be taken as an excl"):
        rw().acquire()
    with pytest.raises(ValueError, match="held as a semaphore and cannot be taken as a shared"):
        rw(shared=True, timeout=1).acquire()
    assert permit.release()
    reader = rw(shared=True)
    assert reader.acquire()
    with pytest.raises(ValueError, match="held as a shared lock and cannot be taken as a sema"):
        sem(timeout=1).acquire()
    assert reader.release()
    writer = rw()
    assert writer.acquire()
    with pytest.raises(ValueError, match="held as an exclusive lock and cannot be taken as a s"):
        sem().acquire()
    assert writer.release()
    assert sem().run(lambda: "either way, once free") == (True, "either way, once free")


def test_inspection_counts_every_holder_and_the_soonest_expiry(
    sem: Callable[..., Lock],
) -> None:
    watcher = sem()
    assert not watcher.is_locked() and watcher.remaining_time() is None
    assert watcher.holders() == [] and watcher.info() is None
    long, short = sem(ttl=30), sem(ttl=5, holder="short one")
    assert long.acquire() and short.acquire()
    assert watcher.is_locked()
    remaining = watcher.remaining_time()
    assert remaining is not None and 4 < remaining <= 5.01  # SQLite counts in julian days
    holders = watcher.holders()
    assert [h.fence for h in holders] == [short.fence, long.fence]
    assert all(h.mode == "semaphore" for h in holders)
    info = watcher.info()
    assert info is not None and info.holder == "short one" and info.owner == short.owner
    assert short.is_owned() and not watcher.is_owned()
    assert long.release() and short.release()


async def test_remaining_time_is_the_last_readers_expiry_and_a_semaphores_soonest(
    rw: Callable[..., Lock], sem: Callable[..., Lock]
) -> None:
    # A writer waits for every reader; a semaphore for one permit. Once the 5 s reader's
    # expiry was the answer for both.
    readers = [rw(shared=True, ttl=ttl) for ttl in (5, 300)]
    assert all([await reader.aacquire() for reader in readers])
    for asker in (rw(), rw(shared=True)):
        for left in (await sync_to_async(asker.remaining_time)(), await asker.aremaining_time()):
            assert left is not None and 200 < left <= 300.01
    for reader in readers:
        assert await reader.arelease()
    permits = [sem(limit=2, ttl=ttl) for ttl in (300, 5)]
    assert all([await permit.aacquire() for permit in permits])
    asker = sem(limit=2)
    for left in (await sync_to_async(asker.remaining_time)(), await asker.aremaining_time()):
        assert left is not None and 4 < left <= 5.01
    for permit in permits:
        assert await permit.arelease()
    assert await asker.aremaining_time() is None


def test_a_permit_expires_at_its_ttl_and_leaves_the_others(sem: Callable[..., Lock]) -> None:
    short, long = sem(limit=2, ttl=0.3, on_lost="warn"), sem(limit=2, ttl=30)
    assert short.acquire() and long.acquire()
    assert not sem(limit=2).acquire()
    time.sleep(0.45)
    third = sem(limit=2)
    assert third.acquire()
    assert not short.release() and short.lost
    assert long.is_owned()
    long.extend()
    assert long.release() and third.release()


def test_serialized_permit_is_restored_with_its_mode_and_can_be_released(
    sem: Callable[..., Lock], rw: Callable[..., Lock]
) -> None:
    permit = sem(limit=2, ttl=30)
    assert permit.acquire()
    restored = restore_lock(permit.serialize())
    assert restored.mode == permit.mode and restored.fence == permit.fence
    restored.extend(60)
    assert restored.release()
    assert not permit.is_owned()
    reader = rw(shared=True)
    assert reader.acquire()
    again = restore_lock(reader.serialize())
    assert again.mode.kind == "shared" and again.is_owned() and again.release()


def test_watchdog_keeps_a_permit_past_its_ttl(sem: Callable[..., Lock]) -> None:
    with sem(ttl=0.3, auto_extend=True) as permit:
        time.sleep(0.8)
        assert permit.is_owned()
        assert sem(limit=1).holders()[0].owner == permit.owner


def test_force_released_permit_raises_on_leaving_the_block(
    sem: Callable[..., Lock], store_alias: str
) -> None:
    other = sem()
    assert other.acquire()
    with pytest.raises(LockNotHeldError, match="was lost"):
        with sem() as permit:
            freed = force_release(permit.key, store=store_alias, fence=permit.fence)
            assert freed is not None and freed.owner == permit.owner
    assert other.is_owned() and other.release()


def test_fences_strictly_increase_across_modes(
    sem: Callable[..., Lock], rw: Callable[..., Lock]
) -> None:
    fences = []
    for make in (sem, lambda: rw(shared=True), rw, sem):
        handle = make()
        assert handle.acquire()
        fences.append(handle.fence)
        assert handle.release()
    assert fences == sorted(fences) and len(set(fences)) == 4  # type: ignore[type-var]


async def test_async_semaphore_and_shared_lock(
    sem: Callable[..., Lock], rw: Callable[..., Lock]
) -> None:
    full = [sem(limit=2) for _ in range(2)]
    for handle in full:
        assert await handle.aacquire()
    waiter = sem(limit=2, timeout=10)
    task = asyncio.ensure_future(waiter.aacquire())
    await asyncio.sleep(0.2)
    assert not task.done()
    assert await full[0].arelease()
    assert await asyncio.wait_for(task, 5)
    assert [h.fence for h in await waiter.aholders()] == sorted([full[1].fence, waiter.fence])
    for handle in (full[1], waiter):
        assert await handle.arelease()
    async with rw(shared=True) as reader:
        async with rw(shared=True):
            assert len(await reader.aholders()) == 2
            assert await reader.ais_owned()
    assert (await rw().arun(lambda: "alone")) == (True, "alone")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"limit": 0}, ValueError, "limit must be >= 1"),
        ({"limit": "3"}, TypeError, "limit must be an int >= 1, got '3'"),
        ({"limit": True}, TypeError, "limit must be an int >= 1, got True"),
        ({"limit": 2.0}, TypeError, "limit must be an int"),
        ({"limit": 2, "shared": True}, ValueError, "not both"),
        ({"shared": "yes"}, TypeError, "shared must be True or False"),
    ],
)
def test_bad_limit_or_shared_is_refused_naming_the_argument(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Lock("bad-input", store="memory", **kwargs)


@pytest.mark.parametrize("limit", [2**63, 2**64, 10**30])
def test_a_limit_above_what_every_store_keeps_is_refused_naming_limit_on_every_store(
    sem: Callable[..., Lock], limit: int
) -> None:
    # PostgreSQL keeps a limit in a bigint: one past it once failed there alone, naming the
    # key and the holder as what the store could not keep.
    with pytest.raises(ValueError, match=rf"limit must be at most 2\*\*63 - 1 .*got {limit}$"):
        sem(limit=limit)


def test_the_largest_limit_takes_and_frees_permits_on_every_store(
    sem: Callable[..., Lock],
) -> None:
    largest = 2**63 - 1
    first, second = sem(limit=largest), sem(limit=largest)
    assert first.acquire() and second.acquire()
    assert second.fence > first.fence  # type: ignore[operator]
    assert len(first.holders()) == 2
    assert first.release() and second.release()
    assert not first.is_locked()


def test_semaphore_needs_a_limit() -> None:
    with pytest.raises(TypeError, match="needs limit="):
        semaphore("no-limit", limit=None, store="memory")  # type: ignore[arg-type]


def test_a_store_without_modes_refuses_limit_and_shared_naming_itself(key: str) -> None:
    with serving(DictLockStore("no-modes")) as alias:
        with pytest.raises(ValueError, match=r"limit= needs a store with semaphores.*'no-modes'"):
            semaphore(key, limit=2, store=alias)
        with pytest.raises(ValueError, match=r"shared=True needs .*\(DictLockStore\) has none"):
            lock(key, shared=True, store=alias)
        assert lock(key, store=alias).run(lambda: 1) == (True, 1)


# -- the surfaces ---------------------------------------------------------------------------
def test_locked_with_limit_lets_limit_calls_in_and_refuses_the_next(
    store_alias: str, key: str
) -> None:
    @locked(key, limit=2, store=store_alias)
    def export() -> str:
        return "done"

    others = [semaphore(key, limit=2, store=store_alias) for _ in range(2)]
    assert others[0].acquire()
    assert export() == "done"  # one place left
    assert others[1].acquire()
    with pytest.raises(LockUnavailable, match=r"export not run: semaphore .* no free permit"):
        export()
    assert others[0].release() and others[1].release()

    @locked(key, shared=True, store=store_alias)
    def read() -> str:
        return "read"

    with lock(key, shared=True, store=store_alias):
        assert read() == "read"


def test_lock_view_with_limit_answers_409_with_the_soonest_permit_expiry(
    store_alias: str, key: str, rf: RequestFactory
) -> None:
    @lock_view(key + ":<pk>", limit=2, store=store_alias)
    def export_view(request: HttpRequest, pk: int) -> HttpResponse:
        return HttpResponse(f"exported {pk}")

    class ExportView(LockViewMixin, View):
        lock_key = key + ":<pk>"
        lock_limit = 2
        lock_store = store_alias

        def get(self, request: HttpRequest, pk: int) -> HttpResponse:
            return HttpResponse("class-based")

    permits = [semaphore(f"{key}:7", limit=2, ttl=ttl, store=store_alias) for ttl in (60, 9)]
    assert permits[0].acquire()
    assert export_view(rf.get("/"), pk=7).content == b"exported 7"
    assert permits[1].acquire()
    for response in (export_view(rf.get("/"), pk=7), ExportView.as_view()(rf.get("/"), pk=7)):
        assert response.status_code == 409
        assert 8 <= int(response["Retry-After"]) <= 10  # the 9 s permit, not the 60 s one
        assert b"all 2 permits" in response.content
    assert permits[1].release()
    assert ExportView.as_view()(rf.get("/"), pk=7).content == b"class-based"


async def test_async_lock_view_with_limit_answers_409_with_the_soonest_permit_expiry(
    store_alias: str, key: str, rf: RequestFactory
) -> None:
    @lock_view(key + ":<pk>", limit=2, store=store_alias)
    async def export_view(request: HttpRequest, pk: int) -> HttpResponse:
        return HttpResponse(f"exported {pk}")

    permits = [semaphore(f"{key}:7", limit=2, ttl=ttl, store=store_alias) for ttl in (60, 9)]
    assert all([await permit.aacquire() for permit in permits])
    response = await export_view(rf.get("/"), pk=7)
    assert response.status_code == 409
    assert 8 <= int(response["Retry-After"]) <= 10  # the 9 s permit, not the 60 s one
    for permit in permits:
        assert await permit.arelease()
    assert (await export_view(rf.get("/"), pk=7)).content == b"exported 7"
