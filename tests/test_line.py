"""The line of waiters (stores with `queues`): waiting processes get an exclusive lock in the
order they asked, a release wakes only the first of them, and one that leaves or dies does
not hold the others up for long."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from django_keel_lock import lock
from django_keel_lock.registry import get_lock_store
from django_keel_lock.stores.base import QUEUE_LEASE

from .conftest import TimeLimit, store_params
from .support.holders import held_before_children

QUEUE_STORES = ["redis", "postgres", "mariadb"]
#: Polls are 5 s apart: whatever a waiter gets within the bounds below came by a push.
RETRY_DELAY = 5.0
CONTEXT = multiprocessing.get_context("fork")


def _waiter(
    alias: str, key: str, timeout: float, hold: float, use_async: bool, pipe: Connection
) -> None:
    """Wait for `key` (telling the parent just before), hold it `hold` s, release; send back
    (acquired, when by the monotonic clock, its fence, when each attempt was made, seconds
    waited)."""
    store = get_lock_store(alias)
    attempts: list[float] = []
    ask, aask = store.acquire_queued, store.aacquire_queued

    def counted(*args: Any) -> Any:
        attempts.append(time.monotonic())
        return ask(*args)

    async def acounted(*args: Any) -> Any:
        at, before = time.monotonic(), len(attempts)
        result = await aask(*args)
        if len(attempts) == before:  # native (Redis); else it ran acquire_queued, counted
            attempts.append(at)
        return result

    store.acquire_queued, store.aacquire_queued = counted, acounted  # type: ignore[method-assign]
    handle = lock(key, ttl=30, store=alias)
    handle.is_locked()  # connected before it asks
    pipe.send("asking")
    asked = time.monotonic()
    if use_async:
        got = asyncio.run(handle.aacquire(timeout=timeout, retry_delay=RETRY_DELAY))
    else:
        got = handle.acquire(timeout=timeout, retry_delay=RETRY_DELAY)
    at = time.monotonic()
    if got:
        time.sleep(hold)
        fence = handle.fence
        handle.release()
    else:
        fence = None
    pipe.send((got, at, fence, attempts, at - asked))


def _start(
    alias: str, key: str, timeout: float = 30, hold: float = 0.02, use_async: bool = False
) -> tuple[Any, Connection]:
    parent, child = CONTEXT.Pipe()
    proc = CONTEXT.Process(
        target=_waiter, args=(alias, key, timeout, hold, use_async, child), daemon=True
    )
    proc.start()
    assert parent.poll(30) and parent.recv() == "asking"
    time.sleep(0.25)  # it has asked and stands in line
    return proc, parent


def _quitter(alias: str, key: str, use_async: bool, pipe: Connection) -> None:
    """Wait for `key` until the parent says "give up": then, sync, an exception raised by a
    signal handler (as a task's time limit is) lands in the wait 50 ms after the next
    attempt; async, the waiting task is cancelled while its next attempt is in flight. Send
    back how the wait ended."""
    store = get_lock_store(alias)
    ask, aask = store.acquire_queued, store.aacquire_queued

    def interrupt(signum: int, frame: object) -> None:
        raise TimeLimit

    def arming(*args: Any) -> Any:
        result = ask(*args)
        if pipe.poll():  # the place is renewed: lands in the pause after this attempt
            signal.setitimer(signal.ITIMER_REAL, 0.05)
        return result

    async def cancelling(*args: Any) -> Any:
        if pipe.poll():
            waiting.cancel()  # lands while this attempt is in flight
        return await aask(*args)

    async def wait() -> str:
        nonlocal waiting
        waiting = asyncio.current_task()  # type: ignore[assignment]
        try:
            return str(await handle.aacquire(timeout=30, retry_delay=RETRY_DELAY))
        except asyncio.CancelledError:
            return "cancelled"

    waiting: asyncio.Task[Any]
    store.acquire_queued, store.aacquire_queued = arming, cancelling  # type: ignore[method-assign]
    signal.signal(signal.SIGALRM, interrupt)
    handle = lock(key, ttl=30, store=alias)
    handle.is_locked()  # connected before it asks
    pipe.send("asking")
    if use_async:
        outcome = asyncio.run(wait())
    else:
        try:
            outcome = str(handle.acquire(timeout=30, retry_delay=RETRY_DELAY))
        except TimeLimit:
            outcome = "interrupted"
    pipe.send(outcome)


@pytest.fixture(params=store_params(QUEUE_STORES))
def line_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_waiting_processes_get_the_lock_in_the_order_they_asked_each_woken_once(
    line_alias: str, key: str
) -> None:
    holder = held_before_children(line_alias, key)
    waiters = [_start(line_alias, key, use_async=i % 2 == 1) for i in range(6)]
    released = time.monotonic()
    assert holder.release()
    results = [pipe.recv() if pipe.poll(20) else None for _, pipe in waiters]
    for proc, _ in waiters:
        proc.join(10)
    assert all(result is not None and result[0] for result in results), results
    order = sorted(range(len(results)), key=lambda i: results[i][1])
    assert order == list(range(len(results)))
    fences = [results[i][2] for i in order]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert all(fence > holder.fence for fence in fences)
    # Between the first release and its turn, each asked when woken and perhaps once to keep
    # its place (every QUEUE_LEASE / 2): not once for each release before its turn (woken
    # by every release, the last would ask six times).
    for _, at, _, attempts, _ in results:
        assert len([t for t in attempts if released <= t <= at]) <= 2, results
    assert results[order[-1]][1] - released < 2.0  # six short holds, each handed over by a push


def test_a_waiter_that_gives_up_passes_its_turn_to_the_next(line_alias: str, key: str) -> None:
    holder = held_before_children(line_alias, key)
    quitter = _start(line_alias, key, timeout=0.3)
    stayer = _start(line_alias, key, timeout=30)
    assert quitter[1].poll(5) and quitter[1].recv()[0] is False  # gave up, left the line
    released = time.monotonic()
    assert holder.release()
    assert stayer[1].poll(10)
    got, at, *_ = stayer[1].recv()
    assert got and at - released < 0.2, at - released


def test_a_waiter_killed_first_in_line_holds_the_next_up_at_most_its_lease(
    line_alias: str, key: str
) -> None:
    holder = held_before_children(line_alias, key)
    doomed, _ = _start(line_alias, key)
    stayer = _start(line_alias, key)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(5)
    released = time.monotonic()
    assert holder.release()
    assert stayer[1].poll(10)
    got, at, *_ = stayer[1].recv()
    # The dead one's place lapses QUEUE_LEASE after its last attempt; the next asks again
    # at least every QUEUE_LEASE / 2.
    assert got and at - released < QUEUE_LEASE * 1.5 + 0.5, at - released


def test_a_lock_nobody_waits_for_is_taken_by_a_waiting_acquire_at_once(
    line_alias: str, key: str
) -> None:
    first = lock(key, ttl=30, store=line_alias)
    assert first.acquire(timeout=5)
    assert first.release()
    second = lock(key, ttl=30, store=line_alias)
    assert second.acquire(timeout=5) and second._attempts == 1
    assert second.fence > first.fence
    second.release()


def test_a_reader_behind_a_line_whose_first_died_gets_the_freed_lock_within_a_lease(
    line_alias: str, key: str
) -> None:
    # The holder is a store of its own, as in another process: its release wakes none of
    # this process's waiters itself.
    store = get_lock_store(line_alias)
    holder = type(store)(f"{line_alias}-holder", store.options)
    try:
        assert holder.acquire(key, "a" * 32, "holder", 30).acquired
        store.close()  # the child must not share this process's connections
        doomed, _ = _start(line_alias, key)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(5)
        reader = lock(key, shared=True, ttl=30, store=line_alias)
        got: list[tuple[bool, float]] = []
        thread = threading.Thread(
            target=lambda: got.append(
                (reader.acquire(timeout=20, retry_delay=RETRY_DELAY), time.monotonic())
            )
        )
        thread.start()
        time.sleep(0.5)  # the reader has asked: the holder's 30 s ttl keeps it out
        released = time.monotonic()
        assert holder.release(key, "a" * 32)  # it wakes only the dead first in line
        thread.join(25)
    finally:
        holder.close()
    ((acquired, at),) = got
    assert acquired and at - released < QUEUE_LEASE * 1.5, at - released
    assert reader.release()


@pytest.mark.parametrize("use_async", [False, True], ids=["interrupted", "cancelled"])
def test_a_waiter_interrupted_or_cancelled_in_line_passes_its_turn_to_the_next(
    line_alias: str, key: str, use_async: bool
) -> None:
    holder = held_before_children(line_alias, key)
    parent, child = CONTEXT.Pipe()
    quitter = CONTEXT.Process(
        target=_quitter, args=(line_alias, key, use_async, child), daemon=True
    )
    quitter.start()
    assert parent.poll(30) and parent.recv() == "asking"
    time.sleep(0.25)  # it stands first in line
    stayer = _start(line_alias, key)
    parent.send("give up")  # at its next attempt, which renews its place
    assert parent.poll(10)
    assert parent.recv() == ("cancelled" if use_async else "interrupted")
    released = time.monotonic()
    assert holder.release()
    assert stayer[1].poll(10)
    got, at, *_ = stayer[1].recv()
    quitter.join(5)
    # Had the quitter kept its place, the release would go to it and the next would wait
    # for the place to lapse, QUEUE_LEASE from the attempt just made.
    assert got and at - released < QUEUE_LEASE / 4, at - released
