"""One handle is one acquisition at a time: a second acquire of a handle that is acquiring or
holding its key, from another task or thread, raises LockError (it would ask with the same
pending owner, and a store grants one owner twice), on every store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from django_keel_lock import Lock, LockError

from .test_database_faults import wait_until

BUSY = r"already acquiring .*each task needs its own handle: lock\(\.\.\.\) per task"


@pytest.mark.parametrize("timeout", [0, 5], ids=["no-wait", "waiting"])
async def test_two_tasks_sharing_a_handle_never_overlap_and_the_second_gets_lock_error(
    make_lock: Callable[..., Lock], timeout: float
) -> None:
    handle = make_lock(ttl=30, timeout=timeout)
    inside: list[str] = []
    overlaps: list[list[str]] = []

    async def task(name: str) -> None:
        async with handle:
            inside.append(name)
            if len(inside) > 1:
                overlaps.append(list(inside))
            await asyncio.sleep(0.2)
            inside.remove(name)

    outcomes = await asyncio.gather(task("a"), task("b"), return_exceptions=True)
    assert not overlaps, f"both bodies ran at once: {overlaps}"
    assert outcomes[0] is None, outcomes
    refused = outcomes[1]
    assert type(refused) is LockError, outcomes  # not LockUnavailable: a mistake, not contention
    assert refused.args and "already acquiring" in str(refused), refused
    assert "each task needs its own handle: lock(...) per task" in str(refused)
    assert not await handle.ais_locked()
    async with handle:  # the handle is whole again once the first task is done with it
        assert handle.held


async def test_a_task_may_not_acquire_a_handle_another_task_waits_with(
    make_lock: Callable[..., Lock],
) -> None:
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    handle = make_lock(ttl=30)
    waiting = asyncio.create_task(handle.aacquire(timeout=10))
    await asyncio.sleep(0.2)  # it waits for the holder
    with pytest.raises(LockError, match=BUSY):
        await handle.aacquire(timeout=10)
    assert not waiting.done()
    assert await holder.arelease()
    assert await asyncio.wait_for(waiting, 10)
    assert handle.held and await handle.arelease()


def test_a_thread_may_not_acquire_a_handle_another_thread_waits_with(
    make_lock: Callable[..., Lock],
) -> None:
    holder = make_lock(ttl=30)
    assert holder.acquire()
    handle = make_lock(ttl=30)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(handle.acquire(timeout=10)))
    thread.start()
    # Until the thread's acquire has begun (and waits for the holder): a fixed sleep could end
    # first on a loaded machine, and then our acquire would be the first, not refused.
    assert wait_until(lambda: handle._acquiring is not None, 10)
    with pytest.raises(LockError, match=BUSY):
        handle.acquire()
    with pytest.raises(LockError, match=BUSY):
        handle.acquire(timeout=1)
    assert holder.release()
    thread.join(10)
    assert got == [True] and handle.held
    with pytest.raises(LockError, match=r"already holds .*lock\(\.\.\.\) per task"):
        handle.acquire()
    assert handle.release()


def test_an_interrupt_as_an_acquire_begins_leaves_the_handle_usable(
    make_lock: Callable[..., Lock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt (or a task's time limit from a signal handler) that lands as the
    acquire begins, here while it draws its owner token, leaves no mark of an acquire under
    way: the next acquire of the handle takes the lock instead of raising "already acquiring"
    for good."""
    handle = make_lock(ttl=30)

    def interrupted(nbytes: int) -> bytes:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr("os.urandom", interrupted)
        patched.setattr("django_keel_lock.core._owners", [])  # none drawn ahead: it draws
        with pytest.raises(KeyboardInterrupt):
            handle.acquire()
    assert handle.acquire()
    assert handle.release()


async def test_a_thread_may_not_acquire_a_handle_a_task_waits_with(
    make_lock: Callable[..., Lock],
) -> None:
    """A task and a thread claim a handle's acquire the same way, in one step: while a task
    waits with the handle, an acquire from a thread is refused, and the task's goes on."""
    holder = make_lock(ttl=30)
    assert await holder.aacquire()
    handle = make_lock(ttl=30)
    waiting = asyncio.create_task(handle.aacquire(timeout=10))
    for _ in range(200):  # until the task's acquire has begun (it waits for the holder)
        if handle._acquiring is not None:
            break
        await asyncio.sleep(0.05)
    assert handle._acquiring is not None

    def from_a_thread() -> bool | BaseException:
        try:
            return handle.acquire(timeout=1)
        except BaseException as error:
            return error

    refused = await asyncio.to_thread(from_a_thread)
    assert type(refused) is LockError and "already acquiring" in str(refused), refused
    assert not waiting.done()
    assert await holder.arelease()
    assert await asyncio.wait_for(waiting, 10)
    assert handle.held and await handle.arelease()
