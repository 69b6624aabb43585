"""The acquisition engine without I/O: the steps it yields for the replies it gets.

The engine is driven here by hand, step by step, as `drivers.run` and `drivers.arun` drive it;
what the drivers then do with the store is the other suites' business (test_line, test_async,
test_semaphores...).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from django_keel_lock import Lock, drivers, engine, lock, semaphore
from django_keel_lock.exceptions import LockStoreUnavailable
from django_keel_lock.stores import AcquireResult, MemoryLockStore
from django_keel_lock.stores.base import EXCLUSIVE, QUEUE_LEASE, Mode
from django_keel_lock.testing import memory_lock_store

SHARED = Mode("shared")


class LineKeepingStore(MemoryLockStore):
    """A memory store that says it keeps a line of waiters (as the Redis store does): the
    engine only reads the flag."""

    queues = True


@dataclass
class Target:
    store: Any = field(default_factory=MemoryLockStore)
    key: str = "invoice:42"
    holder: str = "web-1"
    ttl: float = 30.0
    mode: Mode = EXCLUSIVE
    many: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)


REFUSED = AcquireResult(None, retry_in=5.0, held_as="exclusive")
READERS = AcquireResult(None, retry_in=5.0, held_as="shared")
TAKEN = AcquireResult(7)


def test_a_wait_takes_its_turn_watches_then_asks_plainly_and_returns_what_took_the_lock() -> None:
    deadline = time.monotonic() + 10
    steps = engine.waiting(Target(), "o", deadline, 0.1, tally := [1])
    assert next(steps) == engine.TakeTurn(deadline)
    assert steps.send(True) is engine.WATCH
    first = steps.send(None)
    assert first == engine.Call("acquire", ("invoice:42", "o", "web-1", 30.0))
    assert isinstance(steps.send(REFUSED), engine.Pause)
    assert steps.send(None) == first
    with pytest.raises(StopIteration) as done:
        steps.send(TAKEN)
    assert done.value.value[0] is TAKEN and tally == [2]


def test_a_wait_whose_turn_never_came_asks_the_store_once_itself() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 1, 0.1, [1])
    next(steps)
    assert steps.send(False).op == "acquire"  # not in the line: no place to give up
    with pytest.raises(StopIteration) as done:
        steps.send(REFUSED)
    assert done.value.value[0] is REFUSED


def test_an_exclusive_waiter_that_finds_readers_asks_again_at_once_as_a_writer() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 10, 0.1, [1])
    next(steps)
    steps.send(True)
    assert steps.send(None).op == "acquire_queued"
    writer = steps.send(READERS)  # no pause between the two
    assert writer.op == "acquire_permit" and writer.args[4] is EXCLUSIVE
    assert 0 < writer.args[5] <= QUEUE_LEASE  # its mark keeps readers out for a lease
    pause = steps.send(READERS)
    assert isinstance(pause, engine.Pause) and pause.seconds <= QUEUE_LEASE / 2
    assert steps.send(None).op == "acquire_permit"  # a writer for the rest of the wait


def test_a_wait_in_line_that_times_out_gives_its_place_up_quietly() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 0.05, 0.01, [1])
    next(steps)
    steps.send(True)
    steps.send(None)
    time.sleep(0.06)
    leave = steps.send(REFUSED)
    assert leave == engine.Call("leave_queue", ("invoice:42", "o"), quiet=True)
    with pytest.raises(StopIteration) as done:
        steps.send(LockStoreUnavailable("no answer"))  # logged, not raised
    assert done.value.value[0] is REFUSED


def test_a_wait_that_the_store_fails_keeps_its_place_which_lapses_by_itself() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 10, 0.1, [1])
    next(steps)
    steps.send(True)
    steps.send(None)
    with pytest.raises(LockStoreUnavailable):
        steps.throw(LockStoreUnavailable("down"))


def test_a_cancelled_attempt_that_took_the_lock_gives_it_back_then_leaves_the_line() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 10, 0.1, [1])
    next(steps)
    steps.send(True)
    steps.send(None)
    cancel = KeyboardInterrupt()
    give_back = steps.throw(engine.Interrupted(cancel, TAKEN))
    assert give_back == engine.Call("release", ("invoice:42", "o"), quiet=True)
    assert steps.send(True).op == "leave_queue"
    with pytest.raises(engine.Interrupted) as raised:
        steps.send(None)
    assert raised.value.cause is cancel


def test_a_cancelled_attempt_that_was_refused_gives_nothing_back() -> None:
    steps = engine.once(Target(mode=SHARED), "o")
    assert next(steps).op == "acquire_permit"
    with pytest.raises(engine.Interrupted):
        steps.throw(engine.Interrupted(KeyboardInterrupt(), READERS))


def test_a_key_held_as_the_other_family_of_modes_is_refused_with_a_clear_error() -> None:
    steps = engine.once(Target(), "o")
    next(steps)
    with pytest.raises(ValueError, match="held as a semaphore and cannot be taken as an excl"):
        steps.send(AcquireResult(None, 1.0, "semaphore"))


def test_a_grant_that_came_after_the_ttl_ran_out_is_given_back_and_counts_as_refused() -> None:
    target = Target(ttl=0.5)
    assert not engine.late(target, TAKEN, time.monotonic())
    assert not engine.late(target, REFUSED, time.monotonic() - 1)
    steps = engine.acquisition(target, "o", 0, 0.1, [1])
    assert next(steps).op == "acquire"
    time.sleep(0.6)  # the answer comes after the ttl
    assert steps.send(TAKEN) == engine.Call("release", ("invoice:42", "o"), quiet=True)
    with pytest.raises(StopIteration) as done:
        steps.send(True)
    assert done.value.value[0] is engine.REFUSED


def test_an_acquisition_that_waits_is_a_wait_and_one_that_does_not_a_single_attempt() -> None:
    assert isinstance(next(engine.acquisition(Target(), "o", 1, 0.1, [1])), engine.TakeTurn)
    assert isinstance(next(engine.acquisition(Target(), "o", 0, 0.1, [1])), engine.Call)


@pytest.mark.parametrize("kind", ["exclusive", "shared", "semaphore"])
def test_the_sync_hot_path_answers_as_the_engine_does_on_a_real_store(kind: str) -> None:
    """`drivers.acquire` runs an acquire that does not wait without the generator: it must
    come to what `engine.acquisition` comes to, free, held, and held by the other family."""
    options: dict[str, Any] = {"limit": 1} if kind == "semaphore" else {"shared": kind == "shared"}
    other: dict[str, Any] = {} if kind == "semaphore" else {"limit": 1}
    with memory_lock_store() as store:

        def both(handle: Lock) -> list[Any]:
            answers: list[Any] = []
            for way in ("hot", "engine"):
                owner = f"{way}-{kind}"
                if way == "hot":
                    outcome = drivers.acquire(handle, store, owner, 0, 0.1)
                else:
                    steps = engine.acquisition(handle, owner, 0, 0.1, tally := [1])
                    try:
                        outcome = (*drivers.run(steps, store, handle.key), tally[0])
                    except ValueError as error:
                        outcome = (error, 0.0, 1)
                result = outcome[0]
                if isinstance(result, BaseException):
                    answers.append(str(result))
                else:  # the holder's time left differs by the time between the two
                    answers.append((result.fence is not None, result.held_as))
                if answers[-1] == (True, None):
                    getattr(store, engine.release_op(handle))(handle.key, owner)
            return answers

        free = both(lock_or_semaphore("engine:free", options))
        assert free == [(True, None), (True, None)]
        holder = lock_or_semaphore("engine:held", {"limit": 1} if kind == "semaphore" else {})
        assert holder.acquire()
        held = both(lock_or_semaphore("engine:held", options))
        assert held[0] == held[1] and held[0][0] is False
        taken = lock_or_semaphore("engine:other", other)
        assert taken.acquire()
        refused = both(lock_or_semaphore("engine:other", options))
        assert refused[0] == refused[1] and "not both" in refused[0]


def lock_or_semaphore(key: str, options: dict[str, Any]) -> Lock:
    if "limit" in options:
        return semaphore(key, **options)
    return lock(key, **options)


# -- grants carried by wake-ups (`WakeBoard.grant`) ---------------------------------------
IN_LINE_REFUSED = AcquireResult(None, retry_in=5.0, held_as="exclusive", last_fence=41)


def _paused_in_line(ttl: float = 30.0) -> tuple[Any, engine.Pause, float]:
    """A wait in a key's line, refused once and paused: (its steps, the pause, a moment
    before its attempt was sent)."""
    steps = engine.waiting(
        Target(LineKeepingStore(), ttl=ttl), "o", time.monotonic() + 10, 0.1, [1]
    )
    next(steps)
    steps.send(True)
    before = time.monotonic()
    assert steps.send(None).op == "acquire_queued"
    pause = steps.send(IN_LINE_REFUSED)
    assert isinstance(pause, engine.Pause)
    return steps, pause, before


def test_a_waiter_in_line_pauses_for_a_grant_to_its_owner() -> None:
    _, pause, _ = _paused_in_line()
    assert pause.owner == "o"


def test_a_waiter_refused_without_the_keys_last_fence_claims_no_carried_grant() -> None:
    steps = engine.waiting(Target(LineKeepingStore()), "o", time.monotonic() + 10, 0.1, [1])
    next(steps)
    steps.send(True)
    steps.send(None)
    assert steps.send(REFUSED).owner == ""


def test_a_carried_grant_makes_the_waiter_the_holder_from_its_refused_attempt_without_a_call() -> (
    None
):
    steps, _, before = _paused_in_line()
    with pytest.raises(StopIteration) as done:
        steps.send(42)  # the grant of fence 42 came: no store call, no leaving the line
    result, sent = done.value.value
    assert result == AcquireResult(42) and before <= sent <= time.monotonic()


def test_a_stale_carried_grant_is_ignored_and_the_waiter_asks_again() -> None:
    steps, _, _ = _paused_in_line()
    assert steps.send(41).op == "acquire_queued"  # fence 41 was drawn before the refusal


def test_a_carried_grant_after_most_of_the_ttl_went_by_is_taken_up_by_a_call() -> None:
    steps, _, _ = _paused_in_line(ttl=0.04)
    time.sleep(engine.CARRIED_AGE * 0.04 + 0.005)
    assert steps.send(42).op == "acquire_queued"


def test_a_wait_that_ends_with_a_carried_grant_untaken_leaves_the_line() -> None:
    steps, _, _ = _paused_in_line()
    assert steps.throw(KeyboardInterrupt()) == engine.Call(
        "leave_queue", ("invoice:42", "o"), quiet=True
    )
    with pytest.raises(KeyboardInterrupt):
        steps.send(None)


def _pause_for_a_grant() -> engine.Steps:
    yield engine.WATCH
    return (yield engine.Pause(10.0, (), "o"))


def test_the_sync_driver_answers_a_pause_with_the_grant_carried_to_its_owner() -> None:
    store = MemoryLockStore()

    def grants() -> None:
        store.wake_board.grant("k", "someone", 8)
        store.wake_board.grant("k", "o", 9)

    threading.Timer(0.05, grants).start()
    assert drivers.run(_pause_for_a_grant(), store, "k", "o") == 9
    with store.watch("k", "o"):
        store.wake_board.grant("k", "someone", 8)
        assert store.wake_board.take_grant("k", "o") is None  # taken once, the owner's only


def test_the_async_driver_answers_a_pause_with_the_grant_carried_to_its_owner() -> None:
    store = MemoryLockStore()

    async def main() -> Any:
        asyncio.get_running_loop().call_later(0.05, store.wake_board.grant, "k", "o", 9)
        return await drivers.arun(_pause_for_a_grant(), store, "k", owner="o")

    assert asyncio.run(main()) == 9


def test_a_grant_for_a_key_nobody_here_watches_is_dropped() -> None:
    store = MemoryLockStore()
    store.wake_board.grant("k", "o", 9)
    with store.watch("k", "o"):
        assert store.wake_board.take_grant("k", "o") is None
        store.wake_board.grant("k", "o", 9)
        store.wake_board.grant("k", "o", 8)  # an older one never replaces it
        assert store.wake_board.take_grant("k", "o") == 9


def test_a_grant_nobody_here_takes_is_given_back() -> None:
    # For an owner that waits for the key nowhere here (another waits for it), or left
    # untaken by its owner when it stops watching: the store's give-back gets it, once.
    store = MemoryLockStore()
    given = queue.Queue[tuple[str, str, int]]()
    store.wake_board.give_back = lambda *grant: given.put(grant)
    with store.watch("k", "other"):
        assert not store.wake_board.grant("k", "gone", 7)
        assert given.get(timeout=5) == ("k", "gone", 7)
        with store.watch("k", "o"), store.watch("k", "o"):
            assert store.wake_board.grant("k", "o", 9)
        assert given.get(timeout=5) == ("k", "o", 9)
        with store.watch("k", "o"):
            assert store.wake_board.grant("k", "o", 10)
            assert store.wake_board.take_grant("k", "o") == 10
    assert store.wake_board.granted("k", "o") is None
    with pytest.raises(queue.Empty):
        given.get(timeout=0.2)  # the grant taken: nothing given back
