"""Lost locks in the corners: the cancellation the core makes of an async body is counted and
taken back exactly (whatever else cancels the task), and a cancellation that arrives while a
late grant is being given back, or while a release or extend finds the lock lost and the
on_lost callable raises, is not swallowed.

Locks are lost the way they are in production (a takeover), on every real store.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from django_keel_lock import Lock, LockNotHeldError, lock
from django_keel_lock.stores import LockStore, RedisLockStore

from .conftest import needs_store, serving
from .support.redis_servers import FaultyProxy
from .test_lost_locks import TTL, take_over


def cancelling() -> int:
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


# -- the body's cancellation, counted ---------------------------------------------------------
async def test_a_block_run_while_its_task_is_already_being_cancelled_still_raises_the_loss(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    # Graceful shutdown: the task was cancelled, and its last piece of work runs under a lock.
    # The loss must read as a loss there too, and the shutdown's cancellation stay pending.
    entered = asyncio.Event()
    seen: list[object] = []

    async def shut_down() -> None:
        try:
            entered.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            try:
                async with make_lock(ttl=TTL, auto_extend=True):
                    await asyncio.to_thread(take_over, store, key)
                    await asyncio.sleep(30)
            except BaseException as exc:
                seen.append(type(exc))
            seen.append(cancelling())
            raise

    task = asyncio.ensure_future(shut_down())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=20 * TTL)
    assert seen == [LockNotHeldError, 1]


async def test_a_handle_lost_twice_in_one_block_takes_back_both_cancellations(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    with pytest.raises(LockNotHeldError):
        async with make_lock(ttl=TTL, auto_extend=True) as held:
            try:
                thief = await asyncio.to_thread(take_over, store, key)
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # the body stops its work, gives the key a moment, takes it again
            await asyncio.to_thread(thief.release)
            assert await held.aacquire()
            await asyncio.to_thread(take_over, store, key)
            await asyncio.sleep(30)
    assert cancelling() == 0


# -- a late grant given back ------------------------------------------------------------------
@pytest.fixture
def proxied_redis() -> Iterator[tuple[FaultyProxy, str]]:
    """A Redis store reaching the suite's Redis server through a FaultyProxy."""
    proxy = FaultyProxy(urlsplit(settings.REDIS_URL).port or 6379)
    url = f"{proxy.url}?socket_timeout=1"
    store = RedisLockStore(f"review-{uuid.uuid4().hex[:8]}", {"URL": url})
    try:
        with serving(store) as alias:
            # Warm up: the connection is open and the scripts loaded before any fault.
            assert lock(f"warm-up:{uuid.uuid4().hex}", store=alias).run(lambda: None).acquired
            yield proxy, alias
    finally:
        proxy.mode = "pass"
        proxy.close()


class _StallOnLateGrant(logging.Handler):
    """When the core says a grant came too late, freeze the store: the give-back then hangs
    the way it does on the slow store that made the grant late."""

    def __init__(self, proxy: FaultyProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def emit(self, record: logging.LogRecord) -> None:
        if "granted after its ttl" in record.getMessage():
            self.proxy.mode = "stall"


@needs_store("redis")
async def test_a_cancellation_during_the_give_back_of_a_late_grant_is_raised(
    proxied_redis: tuple[FaultyProxy, str], key: str
) -> None:
    proxy, alias = proxied_redis
    handle = lock(key, ttl=0.1, store=alias)
    handler = _StallOnLateGrant(proxy)
    logger = logging.getLogger("django_keel_lock")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    proxy.mode = "stall"
    # The acquire is held past its 100 ms ttl, then answered; the give-back stalls.
    threading.Timer(0.4, lambda: setattr(proxy, "mode", "pass")).start()
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.8):  # fires while the give-back hangs
                await handle.aacquire()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        proxy.mode = "pass"
    assert cancelling() == 0
    assert not handle.held


# -- the on_lost callable -----------------------------------------------------------------------
async def test_a_cancellation_during_the_release_is_raised_even_when_on_lost_raises(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    def refuse(handle: Lock) -> None:
        raise RuntimeError("the work under this lock must be redone")

    async def body() -> None:
        async with make_lock(ttl=30, on_lost=refuse):
            await asyncio.to_thread(take_over, store, key)
            task = asyncio.current_task()
            assert task is not None
            # Cancelled the moment the release is sent; the release finds the lock taken.
            asyncio.get_running_loop().call_soon(task.cancel)

    task = asyncio.ensure_future(body())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert task.cancelled()


async def test_a_cancellation_during_an_extend_is_raised_even_when_on_lost_raises(
    make_lock: Callable[..., Lock], store: LockStore, key: str
) -> None:
    def refuse(handle: Lock) -> None:
        raise RuntimeError("the work under this lock must be redone")

    handle = make_lock(ttl=30, on_lost=refuse)
    assert await handle.aacquire()
    thief = await asyncio.to_thread(take_over, store, key)

    async def extend() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_soon(task.cancel)  # as the extend is sent
        await handle.aextend()

    task = asyncio.ensure_future(extend())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    assert task.cancelled() and handle.lost
    assert await asyncio.to_thread(thief.release)
