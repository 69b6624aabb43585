"""The engine's drivers when an acquire is cut short.

Async, in every mode: a task cancelled at each of its await points (acquire, a writer's wait
for readers, release, extend) leaves the store and the handle agreeing: no acquisition held by
nobody, none the handle says it holds and the store does not have, no place left in the key's
line, lock_acquired / lock_released sent once each per acquisition, and each acquire told to
metrics once. A grant that came after its ttl and could not be given back is refused with a
warning. Sync: an exception landing between two of the engine's steps still gives up the
place in the line.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from django_keel_lock import (
    Lock,
    LockNotHeldError,
    drivers,
    engine,
    lock,
    metrics,
    semaphore,
    signals,
)
from django_keel_lock.metrics import Recorder
from django_keel_lock.stores import LockStore, RedisLockStore

from .conftest import needs_store, serving, store_params
from .support.redis_servers import FaultyProxy
from .test_async import Stepper, step

MODE_STORES = store_params(["memory", "sqlite", "postgres", "redis"])

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture(params=MODE_STORES)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """The names of lock_acquired and lock_released, in the order they were sent."""
    seen: list[str] = []
    receivers = []
    for name in ("lock_acquired", "lock_released"):

        def receiver(sender: Any, _name: str = name, **kwargs: Any) -> None:
            seen.append(_name)

        getattr(signals, name).connect(receiver, weak=False)
        receivers.append((getattr(signals, name), receiver))
    yield seen
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def _handle(mode: str, key: str, alias: str, **options: Any) -> Lock:
    if mode == "semaphore":
        return semaphore(key, limit=2, store=alias, **options)
    return lock(key, store=alias, shared=mode == "shared", **options)


async def _agree(store: LockStore, key: str, handle: Lock) -> bool:
    """The handle and the store agree on whether it holds; whether it does."""
    owners = {info.owner for info in await store.aholders(key)}
    info = await store.aget(key)
    if info is not None:
        owners.add(info.owner)
    mine = handle.owner is not None and handle.owner in owners
    pending = handle._next_owner is not None and handle._next_owner in owners
    assert not pending, "an acquisition the handle does not know it holds"
    assert handle.held == mine, f"handle says held={handle.held}, store has it: {mine}"
    return mine


async def _run(stepper: Stepper) -> None:
    """Run the stepper in a task of its own: it ends cancelled exactly when we cancelled it."""
    task = asyncio.create_task(step(stepper))
    await asyncio.wait([task])
    if not task.cancelled():
        task.result()  # its error, if any, fails the test
    assert task.cancelled() == bool(stepper.cancelled_at), "cancellation swallowed or not ours"


@pytest.mark.parametrize("mode", ["exclusive", "shared", "semaphore"])
async def test_async_with_cancelled_at_every_await_point_in_every_mode(
    mode: str, alias: str, key: str, sent: list[str]
) -> None:
    store = _handle(mode, key, alias).store
    for k in range(1, 80):
        sent.clear()
        handle = _handle(mode, key, alias, ttl=30)

        async def use(handle: Lock = handle) -> None:
            async with handle:
                await asyncio.sleep(0)

        stepper = Stepper(use(), k)
        await _run(stepper)
        assert not await _agree(store, key, handle)
        assert sent in ([], ["lock_acquired", "lock_released"]), sent
        if not stepper.cancelled_at:
            assert k > 3
            return
    raise AssertionError("never finished")


async def test_a_writer_waiting_for_readers_cancelled_at_every_await_point(
    alias: str, key: str, sent: list[str]
) -> None:
    """An exclusive waiter finds a reader, waits as a writer (its mark keeps new readers out),
    and the reader leaves meanwhile; cancelled anywhere, nothing is left held, and the key
    is free for the next writer at once (no place left in the line)."""
    store = _handle("shared", key, alias).store
    for k in range(1, 80):
        reader = _handle("shared", key, alias, ttl=30)
        # (The last writer's mark, which keeps readers out, lapses by itself: up to 2 s.)
        assert await reader.aacquire(timeout=5)
        sent.clear()
        handle = _handle("exclusive", key, alias, ttl=30, timeout=10, retry_delay=5)

        async def use(handle: Lock = handle) -> None:
            async with handle:
                await asyncio.sleep(0)

        async def leave_soon(reader: Lock = reader) -> None:
            await asyncio.sleep(0.05)
            await reader.arelease()

        leaving = asyncio.create_task(leave_soon())
        stepper = Stepper(use(), k)
        await _run(stepper)
        await leaving
        assert not await _agree(store, key, handle)
        # The reader's release, and the writer's acquire and release when it got in.
        assert sent.count("lock_acquired") in (0, 1), sent
        assert sent.count("lock_released") == 1 + sent.count("lock_acquired"), sent
        other = _handle("exclusive", key, alias)
        assert await other.aacquire(timeout=0), "a place left in the line"
        assert await other.arelease()
        if not stepper.cancelled_at:
            assert k > 3
            return
    raise AssertionError("never finished")


@pytest.mark.parametrize("mode", ["exclusive", "shared", "semaphore"])
async def test_arelease_and_aextend_cancelled_at_every_await_point(
    mode: str, alias: str, key: str, sent: list[str]
) -> None:
    """The release (or extend) runs to its end; the handle says what the store did, once."""
    store = _handle(mode, key, alias).store
    for operation in ("arelease", "aextend"):
        for k in range(1, 40):
            handle = _handle(mode, key, alias, ttl=30)
            assert await handle.aacquire()
            sent.clear()

            async def act(handle: Lock = handle, operation: str = operation) -> None:
                await getattr(handle, operation)()

            stepper = Stepper(act(), k)
            await _run(stepper)
            held = await _agree(store, key, handle)
            assert held == (operation == "aextend"), (operation, k)
            assert sent == ([] if held else ["lock_released"]), sent
            if held:
                assert await handle.arelease()
            with pytest.raises(LockNotHeldError):
                await handle.aextend()
            if not stepper.cancelled_at:
                break
        else:
            raise AssertionError("never finished")


async def test_cancelled_acquire_then_the_same_handle_acquires_again(
    alias: str, key: str, sent: list[str]
) -> None:
    """A handle whose acquire was cancelled (the grant given back) acquires again, with the
    same owner (the one a lost reply may have left in the store), and releases once."""
    store = _handle("exclusive", key, alias).store
    handle = _handle("exclusive", key, alias, ttl=30)
    for k in range(1, 6):
        stepper = Stepper(handle.aacquire(), k)
        await _run(stepper)
        if not stepper.cancelled_at:
            break
        assert not await _agree(store, key, handle)
    assert await _agree(store, key, handle)
    assert await handle.arelease()
    assert sent == ["lock_acquired", "lock_released"]
    other = _handle("exclusive", key, alias)
    assert await other.aacquire()
    assert await other.arelease()


# -- a grant that came too late, and could not be given back -----------------------------
@pytest.fixture
def late_grant(caplog: pytest.LogCaptureFixture) -> Iterator[tuple[FaultyProxy, str]]:
    """A Redis store behind a proxy that holds the next acquire past its ttl, then freezes
    for the give-back (socket timeout 1 s)."""
    proxy = FaultyProxy(urlsplit(settings.REDIS_URL).port or 6379)
    store = RedisLockStore(f"late-{uuid.uuid4().hex[:8]}", {"URL": f"{proxy.url}?socket_timeout=1"})

    def stall_on_late_grant(record: logging.LogRecord) -> bool:
        # The core says a grant came too late: freeze the store, so that the give-back hangs
        # until the client's socket timeout, as it does on the slow store that made it late.
        if "granted after its ttl" in record.getMessage():
            proxy.mode = "stall"
        return True

    logger = logging.getLogger("django_keel_lock")
    logger.addFilter(stall_on_late_grant)
    caplog.set_level(logging.INFO, logger="django_keel_lock")
    try:
        with serving(store) as alias:
            assert lock(f"warm-up:{uuid.uuid4().hex}", store=alias).run(lambda: None).acquired
            proxy.mode = "stall"
            threading.Timer(0.4, lambda: setattr(proxy, "mode", "pass")).start()
            yield proxy, alias
    finally:
        logger.removeFilter(stall_on_late_grant)
        proxy.mode = "pass"
        proxy.close()


def _not_given_back(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "could not be given back" in record.getMessage()
    ]


@needs_store("redis")
@pytest.mark.parametrize("wait", [0, 5], ids=["once", "waiting"])
def test_a_late_grant_that_cannot_be_given_back_is_refused_with_a_warning(
    late_grant: tuple[FaultyProxy, str], key: str, caplog: pytest.LogCaptureFixture, wait: int
) -> None:
    proxy, alias = late_grant
    handle = lock(key, ttl=0.1, store=alias)
    assert handle.acquire(timeout=wait) is False  # not taken; the give-back's error not raised
    proxy.mode = "pass"
    assert not handle.held
    assert len(_not_given_back(caplog)) == 1, [r.getMessage() for r in caplog.records]


@needs_store("redis")
async def test_a_late_grant_that_cannot_be_given_back_is_refused_with_a_warning_async(
    late_grant: tuple[FaultyProxy, str], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy, alias = late_grant
    handle = lock(key, ttl=0.1, store=alias)
    assert await handle.aacquire() is False
    proxy.mode = "pass"
    assert not handle.held
    assert len(_not_given_back(caplog)) == 1, [r.getMessage() for r in caplog.records]


# -- metrics: each acquire told once, however it ends ----------------------------------------
class Told(Recorder):
    """A recorder that writes down what it is told of each handle, in order."""

    def __init__(self) -> None:
        self.told: dict[int, list[str]] = {}

    def _tell(self, handle: Lock, what: str) -> None:
        self.told.setdefault(id(handle), []).append(what)

    def start(self, handle: Lock, timeout: float) -> Any:
        self._tell(handle, "start")

    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        self._tell(handle, "acquired")

    def refused(self, handle: Lock, *args: Any) -> Any:
        self._tell(handle, "refused")

    def failed(self, handle: Lock, started: Any, error: BaseException, *args: Any) -> Any:
        self._tell(handle, f"failed {type(error).__name__}")

    def ended(self, handle: Lock, kept: Any, end: str, *args: Any) -> None:
        self._tell(handle, f"ended {end}")


@pytest.fixture
def told() -> Iterator[Told]:
    recorder, metrics.recorder = metrics.recorder, Told()
    try:
        yield metrics.recorder  # type: ignore[misc]
    finally:
        metrics.recorder = recorder


@pytest.mark.parametrize("mode", ["exclusive", "shared", "semaphore"])
async def test_each_acquire_is_told_to_metrics_once_when_cancelled_anywhere(
    mode: str, alias: str, key: str, told: Told
) -> None:
    """Waiting for a holder who leaves meanwhile: start, then exactly one of acquired (and
    then its end, released, once), refused or failed (the cancellation)."""
    for k in range(1, 80):
        told.told.clear()  # (a handle of an earlier round may have left its id to a new one)
        # In the way: a writer (of a lock, exclusive or shared), or a full semaphore.
        holders = [_handle("exclusive" if mode != "semaphore" else mode, key, alias, ttl=30)]
        if mode == "semaphore":
            holders.append(_handle(mode, key, alias, ttl=30))
        for holder in holders:
            assert await holder.aacquire()
        handle = _handle(mode, key, alias, ttl=30)

        async def use(handle: Lock = handle) -> None:
            async with handle:
                await asyncio.sleep(0)

        async def leave_soon(holder: Lock = holders[0]) -> None:
            await asyncio.sleep(0.05)
            await holder.arelease()

        handle.timeout, handle.retry_delay = 10, 5
        leaving = asyncio.create_task(leave_soon())
        stepper = Stepper(use(), k)
        await _run(stepper)
        await leaving
        for holder in holders[1:]:
            assert await holder.arelease()
        seen = told.told.pop(id(handle))
        assert seen in (
            ["start", "acquired", "ended released"],
            ["start", "failed CancelledError"],
        ), (k, seen)
        if not stepper.cancelled_at:
            assert k > 3
            return
    raise AssertionError("never finished")


# -- sync: an exception from a signal handler between two steps ------------------------------
class TimeLimit(Exception):
    """What a task's time limit raises from its signal handler."""


def _raise_before_the_first_pause() -> Callable[[FrameType, str, Any], Any]:
    """A trace function that raises TimeLimit in the sync driver's own frame (`drivers.run`)
    as it is about to sleep between two attempts: where a signal handler's exception lands
    when the signal comes while the driver, not the store or the sleep, is running."""
    source, first = inspect.getsourcelines(drivers.run)
    line = first + next(i for i, text in enumerate(source) if "driver.step(step)" in text)
    raised: list[int] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        step = frame.f_locals.get("step")
        pausing = event == "line" and frame.f_lineno == line and type(step) is engine.Pause
        if pausing and not raised:
            raised.append(line)
            raise TimeLimit
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is drivers.run.__code__ else None

    return trace


@pytest.mark.parametrize("alias", store_params(["redis", "postgres"]))
def test_an_exception_landing_between_two_steps_gives_up_the_place_in_line(
    alias: str, key: str
) -> None:
    holder = lock(key, store=alias, ttl=30)
    assert holder.acquire()
    waiter = lock(key, store=alias, ttl=30)
    sys.settrace(_raise_before_the_first_pause())
    try:
        with pytest.raises(TimeLimit):
            waiter.acquire(timeout=5, retry_delay=0.5)
    finally:
        sys.settrace(None)
    assert holder.release()
    other = lock(key, store=alias, ttl=30)
    began = time.monotonic()
    assert other.acquire(timeout=5)
    waited = time.monotonic() - began
    assert other.release()
    # Behind a place left in the line, it waits until the place lapses (QUEUE_LEASE, 2 s).
    assert waited < 1.0, f"waited {waited:.2f}s behind the interrupted waiter's place"
