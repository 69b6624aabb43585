"""Run the engine's steps (`engine`): `run` with the store's sync calls and a `Waiter`, `arun`
with its async calls, `waiting.to_the_end` and an `asyncio.Event`.

The async driver is where cancellation safety lives: every store call it starts runs to its
end; a cancellation that arrives meanwhile is thrown into the engine as `Interrupted`, with
what the call returned, so that the engine gives back what it took, and then raised. A quiet
call (giving back, leaving the line) is never interrupted: a cancellation during one is
raised once the engine is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from time import monotonic
from typing import Any, NamedTuple, TypeVar

from . import engine
from .engine import Call, Interrupted, Pause, Steps, TakeTurn, Target
from .exceptions import LockNotHeldError, LockStoreUnavailable
from .stores.base import LockStore
from .stores.wakeups import AnyWaiter
from .waiting import Turn, to_the_end

__all__ = ["aacquire", "acquire", "arun", "asettle", "give_back_later", "run"]

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")


class Failed(NamedTuple):
    """A step's reply when it raised: the driver throws `error` into the engine."""

    error: BaseException


def resume(steps: Steps, reply: Any) -> tuple[bool, Any]:
    """Hand `reply` to `steps` (thrown in when it is `Failed`): (False, its next step), or
    (True, the value it returned)."""
    try:
        if type(reply) is Failed:
            return False, steps.throw(reply.error)
        return False, steps.send(reply)
    except StopIteration as done:
        return True, done.value


# -- sync ---------------------------------------------------------------------------------
def call(store: LockStore, step: Call) -> Any:
    """Make the store call `step` asks for (a quiet one returns its error)."""
    if not step.quiet:
        return getattr(store, step.op)(*step.args)
    try:
        return getattr(store, step.op)(*step.args)
    except Exception as error:
        return error


#: What a driver watches: a key, or a multi-key lock's keys (it takes no turn then).
Watched = str | tuple[str, ...]


def carried(store: LockStore, key: Watched, step: Pause) -> int | None:
    """A `Pause`'s reply: the fence of a grant of `key` a wake-up carried to the step's
    owner (`WakeBoard.take_grant`), or None."""
    if not step.owner or type(key) is not str:
        return None
    return store.wake_board.take_grant(key, step.owner)


class _Sync:
    """What `run` holds while the engine runs: the turn and the watch (`held`, left last
    first when the block ends), the waiter. Its own exit stack, not contextlib's ExitStack:
    leaving them is on the way from a grant to `acquire()` returning, where ExitStack's
    generality is most of the cost."""

    def __init__(self, store: LockStore, key: Watched, owner: str = "") -> None:
        self.store, self.key, self.owner = store, key, owner
        self.held: list[AbstractContextManager[Any]] = []
        self.waiter: Any = None

    def __enter__(self) -> _Sync:
        return self

    def __exit__(self, *exc: Any) -> None:
        held, error = self.held, None
        while held:
            try:
                held.pop().__exit__(*exc)
            except BaseException as failure:  # the others are left too; the first error goes on
                error = error or failure
        if error is not None:
            raise error

    def enter(self, manager: AbstractContextManager[T]) -> T:
        value = manager.__enter__()
        self.held.append(manager)
        return value

    def step(self, step: Any) -> Any:
        """Run `step`: its reply, or `Failed` with its error."""
        try:
            if type(step) is Call:
                return call(self.store, step)
            if type(step) is Pause:
                if step.keys:
                    self.waiter.wait(step.seconds, step.keys)
                else:
                    self.waiter.wait(step.seconds)
                return carried(self.store, self.key, step)
            if type(step) is TakeTurn:
                assert type(self.key) is str
                return self.enter(Turn.wait_for(self.store, self.key, step.deadline))
            self.waiter = self.watch()
        except BaseException as error:
            return Failed(error)
        return None

    def watch(self) -> Any:
        """Listen for releases of the key (its `Waiter`), or of any of several keys."""
        key = self.key
        if type(key) is str:
            return self.enter(self.store.watch(key, self.owner))
        waiter = AnyWaiter()
        self.enter(self.store.watch_many(key, waiter.wake, self.owner))
        return waiter


def run(steps: Steps, store: LockStore, key: Watched, owner: str = "") -> Any:
    """Run `steps` on `store` with its sync calls; the turn and the watch (of `key`, or of
    each of several keys, for `owner`: the grants carried to it are its) they take last
    until they end. Their value."""
    with _Sync(store, key, owner) as driver:
        reply: Any = None
        while True:
            try:
                done, step = resume(steps, reply)
                if done:
                    return step
                reply = driver.step(step)
            except BaseException as error:
                if inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED:  # the engine's own
                    raise
                # It landed here, between two steps (a signal handler's: a task's time
                # limit): the engine takes it as a step's error, and leaves the line.
                reply = Failed(error)


def acquire(
    target: Target, store: LockStore, owner: str, wait: float, retry_delay: float
) -> engine.Outcome:
    """Acquire for `owner` in the target's `store`, waiting up to `wait` seconds
    (`engine.acquisition`): the last attempt's result, or the error that ended the acquire
    (for the caller to record and raise), when it was sent and the attempts made."""
    if wait <= 0.0:  # one attempt, the hot path: `engine.acquisition` without a generator
        try:
            if target.plain:  # `engine.first_request` of an exclusive lock of one key
                sent = monotonic()
                result = store.acquire(target.key, owner, target.holder, target.ttl)
            else:
                op, args = engine.first_request(target, owner)
                sent = monotonic()
                result = getattr(store, op)(*args)
            # A grant's fence read once, by index (a named tuple's field is found by name:
            # CPython 3.11-3.13 do not specialise it); `engine.check`'s and `engine.late`'s
            # tests first, a call less on the hot path (a grant needs no `check`).
            if result[0] is None:
                if result.held_as is not None:
                    result = engine.check(target, result)
            elif monotonic() >= sent + target.ttl and engine.late(target, result, sent):
                run(engine.giving_back(target, owner), store, engine.subject(target))
                result = engine.REFUSED
        except BaseException as error:
            return error, 0.0, 1
        return result, sent, 1
    tally = [1]
    try:
        steps = engine.acquisition(target, owner, wait, retry_delay, tally)
        result, sent = run(steps, store, engine.subject(target), owner)
    except BaseException as error:
        return error, 0.0, tally[0]
    return result, sent, tally[0]


def give_back_later(store: LockStore, step: Call) -> None:
    """Make the quiet call `step` (a give-back) on the store's worker threads, logging what
    came of it: a lock given up for lost whose last extend had no answer (the store may have
    made it). A release of an owner that no longer holds is refused: harmless."""
    key = step.args[0]

    def done(future: Future[Any]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            logger.info("lock %r: could not give back a lost acquisition (%s)", key, error)
        elif future.result():
            logger.info("lock %r: released the acquisition given up for lost", key)

    try:
        store.submit(getattr(store, step.op), *step.args).add_done_callback(done)
    except RuntimeError as error:  # the interpreter is shutting down: it expires
        logger.info("lock %r: could not give back a lost acquisition (%s)", key, error)


# -- async --------------------------------------------------------------------------------
class _Async:
    """What `arun` holds while the engine runs: the turn and the watch (`held`), the event a
    release sets, a cancellation to raise once the engine is done."""

    def __init__(
        self, store: LockStore, key: Watched, held: contextlib.AsyncExitStack, owner: str = ""
    ) -> None:
        self.store, self.key, self.held, self.owner = store, key, held, owner
        self.woken: asyncio.Event | None = None
        self.heard: set[str] = set()  # the keys whose releases set `woken`
        self.pending: BaseException | None = None

    async def step(self, step: Any) -> Any:
        """Run `step`: its reply, or `Failed` with its error (`Interrupted` when the task
        was cancelled while a call ran)."""
        try:
            if type(step) is Call:
                return await self.call(step)
            if type(step) is Pause:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(step.seconds):
                        await self.wake_up(step.keys)
                return carried(self.store, self.key, step)
            if type(step) is TakeTurn:
                assert type(self.key) is str
                turn = Turn.await_for(self.store, self.key, step.deadline)
                return await self.held.enter_async_context(turn)
            self.watch()
        except BaseException as error:
            return Failed(error)
        return None

    async def call(self, step: Call) -> Any:
        if self.woken is not None and not step.quiet:
            self.woken.clear()  # before the attempt: a release right after it counts
            self.heard.clear()
        future, cancelled = await to_the_end(getattr(self.store, "a" + step.op)(*step.args))
        if step.quiet:
            if cancelled is not None and self.pending is None:
                self.pending = cancelled
            if future.cancelled():
                return asyncio.CancelledError()
            return future.exception() or future.result()
        if cancelled is not None:
            whole = not future.cancelled() and future.exception() is None
            raise Interrupted(cancelled, future.result() if whole else None)
        return future.result()

    def watch(self) -> None:
        """Listen for releases of the key (or of any of several keys): the store's watch
        starts its cross-process listener; the callback is how a task hears of releases (it
        cannot block on the Waiter's condition)."""
        loop = asyncio.get_running_loop()
        woken = self.woken = asyncio.Event()

        def heard(key: str) -> None:
            self.heard.add(key)
            woken.set()

        def wake(key: str) -> None:  # called from whichever thread saw the release
            try:
                loop.call_soon_threadsafe(heard, key)
            except RuntimeError:  # the loop is closed; nobody is waiting any more
                pass

        keys = (self.key,) if type(self.key) is str else self.key
        self.held.enter_context(self.store.watch_many(keys, wake, self.owner))

    async def wake_up(self, keys: tuple[str, ...]) -> None:
        """Until a release of one of `keys` (of any key: none given) was heard since the
        attempt began."""
        woken = self.woken
        assert woken is not None
        await woken.wait()
        while keys and self.heard.isdisjoint(keys):
            woken.clear()
            await woken.wait()


async def arun(
    steps: Steps,
    store: LockStore,
    key: Watched,
    undo: Callable[[Any], Steps | None] | None = None,
    owner: str = "",
) -> Any:
    """`run` for async code: the store's async calls, each run to its end. A cancellation
    that came during a quiet call is raised once the engine is done, after the steps
    `undo(value)` gives (if any) undid what the engine returned."""
    async with contextlib.AsyncExitStack() as held:
        driver = _Async(store, key, held, owner)
        try:
            done, step = resume(steps, None)
            while not done:
                done, step = resume(steps, await driver.step(step))
        except Interrupted as stop:
            raise driver.pending or stop.cause from None
        except BaseException:
            if driver.pending is not None:
                raise driver.pending from None
            raise
        if driver.pending is not None:
            undoing = None if undo is None else undo(step)
            if undoing is not None:
                done, step = resume(undoing, None)
                while not done:
                    done, step = resume(undoing, await driver.step(step))
            raise driver.pending
        return step


async def aacquire(target: Target, owner: str, wait: float, retry_delay: float) -> engine.Outcome:
    """`acquire` for async code: each attempt goes through the engine, whose generator gives
    back what an attempt took when the task is cancelled meanwhile."""
    tally = [1]
    steps = engine.acquisition(target, owner, wait, retry_delay, tally)

    def undo(attempted: engine.Attempted) -> Steps | None:
        # Cancelled during a quiet call after the lock was taken (a multi-key waiter leaving
        # the line it stood in): give it back, or it stays held until its ttl runs out.
        if attempted[0].fence is None:
            return None
        return engine.giving_back(target, owner, "acquired as its waiter was cancelled")

    try:
        result, sent = await arun(steps, target.store, engine.subject(target), undo, owner)
    except BaseException as error:
        return error, 0.0, tally[0]
    return result, sent, tally[0]


async def asettle(
    store: LockStore,
    step: Call,
    settle: Callable[[Any], T],
    failed: Callable[[], None],
    cancelled_failure: str = "",
) -> T:
    """Make the one store call `step` (a release, an extend) to its end and `settle` what it
    answered. `failed()` when it raised LockStoreUnavailable. Cancelled meanwhile, it still
    settles the answer, then raises the cancellation (`cancelled_failure`: the warning when
    there was no answer to settle)."""
    target = step.args[0]
    future, cancelled = await to_the_end(getattr(store, "a" + step.op)(*step.args))
    if not future.cancelled() and isinstance(future.exception(), LockStoreUnavailable):
        failed()
    if cancelled is None:
        return settle(future.result())
    if future.cancelled() or future.exception() is not None:
        if cancelled_failure:
            logger.warning("%s", cancelled_failure)
    else:
        try:
            settle(future.result())
        except LockNotHeldError:
            pass
        except Exception:  # the on_lost callable: the cancellation must not be lost
            logger.exception("on_lost of lock %r raised as its task was cancelled", target)
    raise cancelled


class Body:
    """The task running an async block's body under a lock with auto_extend and
    on_lost="raise", which the watchdog cancels when it finds the lock lost; how many times we
    cancelled it, and how many cancellations it had pending when the block began."""

    __slots__ = ("cancels", "pending", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task, self.cancels, self.pending = task, 0, task.cancelling()

    @classmethod
    def current(cls) -> Body | None:
        """The body running in the current task (None outside one)."""
        task = asyncio.current_task()
        return None if task is None else cls(task)

    def cancel(self) -> None:
        """Stop the body that works under a lock it no longer holds; from any thread."""
        task = self.task
        if task.done():
            return
        self.cancels += 1
        try:
            same_loop = asyncio.get_running_loop() is task.get_loop()
        except RuntimeError:
            same_loop = False
        if same_loop:
            task.cancel()
        else:
            task.get_loop().call_soon_threadsafe(task.cancel)

    def ended(self, error: BaseException | None) -> bool:
        """The block ended with `error`: each cancellation we made is taken back (a body
        that caught one and acquired again may be cancelled twice), those it had before the
        block began stay (cleanup under a lock at shutdown). Whether `error` is ours: a
        cancellation we made and none from elsewhere, which the block turns into
        LockNotHeldError, as `asyncio.timeout` turns its own into TimeoutError."""
        others = self.pending
        for _ in range(self.cancels):
            others = self.task.uncancel()
        ours = bool(self.cancels) and others <= self.pending
        return ours and isinstance(error, asyncio.CancelledError)
