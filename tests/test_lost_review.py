"""Lost locks in the corners: the cancellation the core makes of an async body is counted and
taken back exactly (whatever else cancels the task), and a cancellation that arrives while a
late grant is being given back is not swallowed.

Locks are lost the way they are in production (a takeover), on every real store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from django_keel_lock import Lock, LockNotHeldError
from django_keel_lock.stores import LockStore

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
