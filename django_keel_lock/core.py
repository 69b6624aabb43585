"""The Lock handle: how waiting, ownership, loss and fencing work.

Every surface (context manager, view decorator, management command, admin, Celery) goes
through `Lock`; stores below only answer atomic questions (see `stores.base.LockStore`).

The sync and async methods share every decision (`_wait_args`, `_begin`, `_finish`,
`_released`, `_extend_args`, `_extended`, `waiting.next_delay`); they differ only in how they
wait and call the store. The async ones are cancellation-safe: a store call they start always
runs to its end (`waiting.to_the_end`), so a cancellation never strands a lock nor skips a
release.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar, Unpack, overload

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.dispatch import Signal

from . import metrics, signals, tokens, watchdog
from .durations import Duration, to_seconds
from .exceptions import LockError, LockNotHeldError, LockStoreUnavailable, LockUnavailable
from .options import (
    RAISE,
    HandleOptions,
    LockOptions,
    LockSpec,
    check_store,
    lock_name,
    make_handles_with,
    refuse_option,
    ttl_seconds,
    validate_key,
)
from .registry import get_lock_store
from .stores.base import EXCLUSIVE, QUEUE_LEASE, AcquireResult, LockInfo, LockStore, Mode
from .waiting import Turn, next_delay, to_the_end

__all__ = ["Lock", "LockOutcome", "force_release", "lock", "restore_lock", "semaphore"]

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")


class Lock:
    """A handle on one key in one store. Not shared between threads: make one per worker.

    A handle acquires at most once at a time; each acquisition gets a fresh random `owner`
    token and a `fence` strictly greater than every earlier fence of the key in that store.

    Its `mode` is exclusive (the default), shared (`shared=True`: any number of readers, and
    no writer meanwhile) or a semaphore (`limit=N`: at most N holders, each with a permit of
    its own). Same API and guarantees in every mode.
    """

    # Slots: a handle has more attributes than CPython keeps in a compact instance dict (30),
    # and past that every attribute read on the hot path costs more (0.3 µs a memory-store
    # cycle, 11 %). __weakref__: the watchdog refers to its handle weakly.
    __slots__ = (
        "__weakref__",
        "_acquiring",
        "_attempts",
        "_body",
        "_body_cancels",
        "_body_pending",
        "_held",
        "_lost_reason",
        "_meter",
        "_metered",
        "_mutex",
        "_name",
        "_next_owner",
        "_raises",
        "_renewal",
        "_store",
        "_valid_until",
        "auto_extend",
        "fence",
        "holder",
        "key",
        "lost",
        "max_hold",
        "mode",
        "on_lost",
        "owner",
        "retry_delay",
        "store_alias",
        "timeout",
        "ttl",
    )

    def __init__(self, key: str, **options: Unpack[LockOptions]) -> None:
        """A handle on `key` taken as the `LockOptions` say (all of them: `limit` and
        `shared` too); nothing is acquired until acquire/run/`with`."""
        self._setup(key, LockSpec.of("Lock", options), label=None)

    @classmethod
    def from_spec(
        cls, key: str, spec: LockSpec, *, label: str | None = None, raises: bool = False
    ) -> Lock:
        """A handle on `key` taken as `spec` says (what `LockSpec.lock` returns); `label`
        names the caller in the holder when the spec has none; `raises`: the caller raises
        LockUnavailable when the lock is not acquired (traces mark that refusal an error)."""
        handle = cls.__new__(cls)
        handle._setup(key, spec, label=label, raises=raises)
        return handle

    def _setup(self, key: str, spec: LockSpec, *, label: str | None, raises: bool = False) -> None:
        self._store = get_lock_store(spec.store)
        self.key = validate_key(key, self._store)
        self.ttl = spec.resolved_ttl()
        self.timeout, self.retry_delay = spec.timeout, spec.retry_delay
        self.holder = spec.holder_for(label)
        self.auto_extend, self.max_hold = spec.auto_extend, spec.max_hold
        self.on_lost = spec.on_lost
        self.store_alias = spec.store
        self.mode: Mode = spec.mode
        if spec.mode is not EXCLUSIVE and not self._store.supports_modes:
            what = "limit=" if spec.mode.kind == "semaphore" else "shared=True"
            raise ValueError(
                f"{what} needs a store with semaphores and shared locks; store {spec.store!r} "
                f"({type(self._store).__name__}) has none"
            )
        self.owner: str | None = None
        self._next_owner: str | None = None
        self.fence: int | None = None
        #: True once this acquisition is known lost (expired, taken over, store unreachable).
        self.lost = False
        self._lost_reason = ""
        # The task running an async block's body, cancelled when the watchdog finds the lock
        # lost (on_lost="raise" with auto_extend); how many times we cancelled it, and how
        # many cancellations it already had pending when the block began.
        self._body: asyncio.Task[Any] | None = None
        self._body_cancels = 0
        self._body_pending = 0
        self._held = False
        self._acquiring: object | None = None  # the mark of the acquire under way (`_begin`)
        self._valid_until = math.inf  # monotonic, the last expiry the store confirmed
        self._renewal: watchdog.Renewal | None = None
        self._mutex = threading.Lock()  # state shared with the watchdog
        # What the core tells metrics (see metrics.py): the name (None: the key, normalised
        # when first asked for), whether a refusal raises, the last acquire's store calls; the
        # recorder that saw the current acquisition and when it was sent, one value so that
        # `_ended` takes both at once (None: not measured); and what the recorder last
        # returned (`kept`), handed back to it, never read here.
        self._name = spec.name
        self._raises = raises
        self._attempts = 0
        self._metered: tuple[metrics.Recorder, float] | None = None
        self._meter: Any = None

    @property
    def name(self) -> str:
        """What metrics and traces call this lock: the `name=` it was given (a surface's key
        template), else its key with digits, UUIDs and long hex as `*` (`options.lock_name`)."""
        if self._name is None:
            self._name = lock_name(self.key)
        return self._name

    # -- acquiring ------------------------------------------------------------------------
    def acquire(self, timeout: Duration | None = None, retry_delay: Duration | None = None) -> bool:
        """Take the lock, waiting up to `timeout` seconds (default: the handle's, 0 = no wait).

        True if acquired. Raises LockStoreUnavailable if the store cannot be reached.
        """
        wait, delay = self._wait_args(timeout, retry_delay)
        mine = object()  # this acquire's mark on the handle (`_begin`)
        try:
            owner = self._begin(mine)
            recorder = metrics.recorder  # None while metrics are off: their only cost then
            started: Any = None
            try:
                if wait <= 0:
                    sent = time.monotonic()
                    if recorder is not None:  # a span opens, or the wait is timed from `sent`
                        started = recorder.start(self, wait) if recorder.traces else sent
                    result = self._ask(owner, None, self._plain(None))
                else:
                    if recorder is not None:
                        started = (
                            recorder.start(self, wait) if recorder.traces else time.monotonic()
                        )
                    result, sent = self._wait(owner, wait, delay)
            except BaseException as error:
                if recorder is not None:
                    self._failed(recorder, started, wait, error)
                raise
            if not self._finish(owner, result, sent):
                if result.fence is not None:  # granted too late: give it back
                    try:
                        self._release_op(self.key, owner)
                    except LockStoreUnavailable:
                        pass  # it is past its ttl already
                if recorder is not None:
                    self._refused(recorder, started, wait)
                return False
            renewal = self._taken(recorder, started, wait, owner, sent)
            if renewal is not None:
                renewal.start_thread()
            return True
        finally:
            if self._acquiring is mine:  # not another acquire's, refused by _begin
                self._acquiring = None

    def _taken(
        self, recorder: metrics.Recorder | None, started: Any, wait: float, owner: str, sent: float
    ) -> watchdog.Renewal | None:
        """Tell the recorder of an acquisition taken (a wait counted its store calls in
        `_attempts`); its watchdog, to start in the caller's way, when `auto_extend`."""
        if recorder is not None:
            self._metered = recorder, sent
            attempts = 1 if wait <= 0 else self._attempts
            self._meter = recorder.acquired(self, started, attempts, self._meter)
        if self.auto_extend:
            self._renewal = watchdog.Renewal(self, owner, sent)
            return self._renewal
        return None

    # What an acquire that was not taken tells the recorder (one that was: `_taken`). A wait
    # counted its store calls in `_attempts`.
    def _refused(self, recorder: metrics.Recorder, started: Any, wait: float) -> None:
        outcome = "timeout" if wait > 0 else "contended"
        attempts = 1 if wait <= 0 else self._attempts
        self._meter = recorder.refused(self, started, outcome, attempts, self._raises, self._meter)

    def _failed(
        self, recorder: metrics.Recorder, started: Any, wait: float, error: BaseException
    ) -> None:
        attempts = 1 if wait <= 0 else self._attempts
        self._meter = recorder.failed(self, started, error, attempts, self._meter)

    def _wait_args(
        self, timeout: Duration | None, retry_delay: Duration | None
    ) -> tuple[float, float]:
        wait = self.timeout if timeout is None else to_seconds("timeout", timeout, allow_zero=True)
        delay = (
            self.retry_delay
            if retry_delay is None
            else to_seconds("retry_delay", retry_delay, allow_zero=True)
        )
        return wait, delay

    def _plain(self, last: AcquireResult | None, plain: bool = True) -> bool:
        """Whether the next acquire attempt, after `last` (None: the first) of one asked
        `plain` or not, is the store's plain `acquire` (else `acquire_permit`).

        An exclusive lock asks as `acquire` does, the fast path, until it finds readers in
        its way; from then on, for the rest of the wait, as a writer waiting for them, through
        `acquire_permit`, which keeps new readers out while it waits (for QUEUE_LEASE after
        each attempt) and withdraws that when it takes the lock; taken through `acquire`, the
        mark would keep readers out of a key nobody holds until it lapsed."""
        return plain and self.mode is EXCLUSIVE and (last is None or last.held_as != "shared")

    def _queued(self) -> bool:
        """Whether this handle's waits stand in the store's line of waiters (see
        `LockStore.acquire_queued`): exclusive locks, on stores that keep one."""
        return self.mode is EXCLUSIVE and self._store.queues

    def _ask(
        self, owner: str, deadline: float | None, plain: bool, queued: bool = False
    ) -> AcquireResult:
        """One acquire attempt (`plain` or not: see `_plain`; `queued`: in the key's line of
        waiters), waiting as a writer until `deadline` (None: no wait); checked (`_checked`)."""
        store = self._store
        if plain and queued:
            result = store.acquire_queued(self.key, owner, self.holder, self.ttl)
        elif plain:
            result = store.acquire(self.key, owner, self.holder, self.ttl)
        else:
            wait = _writer_wait(deadline)
            result = store.acquire_permit(self.key, owner, self.holder, self.ttl, self.mode, wait)
        return result if result.held_as is None else self._checked(result)

    def _checked(self, result: AcquireResult) -> AcquireResult:
        """`result`, unless it says the key is in use by the other family of modes: a key is
        a semaphore or a lock (exclusive and shared), not both at once."""
        held = result.held_as
        if held is None or result.fence is not None:
            return result
        if (held == "semaphore") != (self.mode.kind == "semaphore"):
            raise ValueError(
                f"key {self.key!r} is held as {_kind_phrase(held)} and cannot be taken as "
                f"{_kind_phrase(self.mode.kind)} at the same time: a key is a semaphore or a "
                "lock, not both (use a key of its own for each); once every holder has gone it "
                "may be used either way"
            )
        return result

    def _pause(
        self, result: AcquireResult, retry_delay: float, left: float, plain: bool, queued: bool
    ) -> float:
        """How long to wait after the refusal `result` of a `plain` acquire or not (`queued`:
        in the key's line): not at all when an exclusive lock has just found readers (it asks
        again at once, as a writer who waits, so that new readers stop coming in: see
        `_plain`)."""
        writer = self.mode is EXCLUSIVE and not plain
        if plain and self.mode is EXCLUSIVE and result.held_as == "shared":
            return 0.0
        pause = min(left, next_delay(retry_delay, result.retry_in, self._store.push_wakeups))
        # A place in the line, and a waiting writer's mark, last QUEUE_LEASE from the last
        # attempt: keep them. A caller outside the line that an exclusive holder keeps out is
        # not woken by the release when the line has a first waiter, who may never take the
        # lock (its process died; it gave up as the release came): look again as often.
        if queued or writer or (self._store.queues and result.held_as == "exclusive"):
            return min(pause, QUEUE_LEASE / 2)
        return pause

    @property
    def _release_op(self) -> Callable[[str, str], bool]:
        store = self._store
        return store.release if self.mode is EXCLUSIVE else store.release_permit

    @property
    def _arelease_op(self) -> Callable[[str, str], Awaitable[bool]]:
        store = self._store
        return store.arelease if self.mode is EXCLUSIVE else store.arelease_permit

    @property
    def extend_op(self) -> Callable[[str, str, float], bool]:
        """The store operation that extends this handle's acquisition (the watchdog's)."""
        store = self._store
        return store.extend if self.mode is EXCLUSIVE else store.extend_permit

    @property
    def aextend_op(self) -> Callable[[str, str, float], Awaitable[bool]]:
        """`extend_op` for async code."""
        store = self._store
        return store.aextend if self.mode is EXCLUSIVE else store.aextend_permit

    def _begin(self, mine: object) -> str:
        """The owner token for an acquire, whose mark `mine` the handle then carries until the
        acquire clears it (in its `finally`, which starts before this call: an exception
        landing anywhere after the mark is set still clears it)."""
        if self._held and time.monotonic() >= self._valid_until:
            # By its own clock the lock ran out: the handle holds nothing and may try again.
            self._lost("its ttl ran out without a confirmed extend", owner=self.owner)
        with self._mutex:
            if self._held or self._acquiring is not None:
                raise LockError(self._busy_message())
            # The owner stays the same for every attempt until one succeeds: an attempt whose
            # reply was lost (timeout, dropped connection) may still have taken the lock, and a
            # retry with the same owner gets it back instead of stranding it until its ttl.
            if self._next_owner is None:
                self._next_owner = secrets.token_hex(16)
            # Until this acquire ends, another acquire of the handle is refused:
            # it would ask with the same pending owner, and the store grants one owner twice.
            self._acquiring = mine
            return self._next_owner

    def _busy_message(self) -> str:
        """Why an acquire of this handle is refused while it holds or acquires its key."""
        if self._held:
            return (
                f"this handle already holds {self.key!r}; release it first or make a new handle "
                "(each task or thread needs its own handle: lock(...) per task)"
            )
        return (
            f"this handle is already acquiring {self.key!r} (in another task or thread); each "
            "task needs its own handle: lock(...) per task"
        )

    def _leave_queue(self, owner: str) -> None:
        """Give up `owner`'s place in the key's line (it stops waiting): the next in line is
        not held up. Never raises: it runs on the way out of a wait that may be raising
        already (whose error must stay the one raised); a place not given up lapses by itself
        (a wait that ends with a store error does not try: the error would come twice as
        late)."""
        try:
            self._store.leave_queue(self.key, owner)
        except Exception as error:
            self._not_left(error)

    async def _aleave_queue(self, owner: str) -> None:
        """`_leave_queue` for async code; runs to its end even if the task is cancelled (the
        cancellation is raised after it)."""
        done, cancelled = await to_the_end(self._store.aleave_queue(self.key, owner))
        error = None if done.cancelled() else done.exception()
        if error is not None:
            self._not_left(error)
        if cancelled is not None:
            raise cancelled

    def _not_left(self, error: BaseException) -> None:
        """Log why leaving the line failed: the place lapses QUEUE_LEASE after its last attempt."""
        unreachable = isinstance(error, LockStoreUnavailable)
        logger.log(
            logging.DEBUG if unreachable else logging.WARNING,
            "lock %r: could not leave the line of waiters (%s: %s); the place lapses in %gs",
            self.key,
            type(error).__name__,
            error,
            QUEUE_LEASE,
            exc_info=None if unreachable else error,
        )

    def _finish(self, owner: str, result: AcquireResult, sent: float) -> bool:
        """Take on the outcome of an acquire attempt sent at monotonic time `sent`. False when
        not acquired, or acquired too late: the ttl (counted from `sent`) ran out before the
        answer came, so the lock may already be someone else's."""
        if result.fence is None:
            logger.debug("lock %r is held by someone else", self.key)
            return False
        if time.monotonic() >= sent + self.ttl:
            logger.info(
                "lock %r was granted after its ttl of %gs ran out; not taken", self.key, self.ttl
            )
            return False
        with self._mutex:
            self.owner, self.fence, self._held, self.lost = owner, result.fence, True, False
            self._next_owner = None
            # The store started the ttl after we sent the call: counting from `sent` errs early.
            self._valid_until = sent + self.ttl
        _announce(signals.lock_acquired, lock=self)
        return True

    def _wait(self, owner: str, timeout: float, retry_delay: float) -> tuple[AcquireResult, float]:
        store = self._store
        deadline = time.monotonic() + timeout
        self._attempts = 1
        with Turn.wait_for(store, self.key, deadline) as mine:
            if not mine:
                # The turn did not come by the deadline. Whoever has it may be stuck on a store
                # that does not answer, so ask the store once ourselves: "held by someone else"
                # must be the store's word, and an outage must reach every caller as one.
                sent = time.monotonic()
                return self._ask(owner, None, self._plain(None)), sent
            queued = self._queued()
            # Whether the way out gives up a place in the line: every way but taking the lock
            # (the place goes with it) and the store failing (the place lapses by itself; trying
            # would only make the error come twice as late): the deadline, an exception from a
            # signal handler (a task's time limit), SystemExit, KeyboardInterrupt.
            leave = queued
            try:
                with store.watch(self.key) as waiter:
                    last: AcquireResult | None = None
                    plain = True
                    self._attempts = 0
                    while True:
                        self._attempts += 1
                        sent = time.monotonic()
                        plain = self._plain(last, plain)
                        result = self._ask(owner, deadline, plain, queued)
                        left = deadline - time.monotonic()
                        if result.fence is not None or left <= 0:
                            leave = leave and result.fence is None
                            return result, sent
                        last = result
                        pause = self._pause(result, retry_delay, left, plain, queued)
                        if pause > 0:
                            waiter.wait(pause)
            except LockStoreUnavailable:
                leave = False
                raise
            finally:
                if leave:
                    self._leave_queue(owner)

    # -- acquiring, async -----------------------------------------------------------------
    async def aacquire(
        self, timeout: Duration | None = None, retry_delay: Duration | None = None
    ) -> bool:
        """`acquire` for async code: waits without blocking the event loop.

        Cancelled while waiting or while an attempt is in flight, it leaves no lock behind,
        nor a place in the key's line of waiters."""
        wait, delay = self._wait_args(timeout, retry_delay)
        mine = object()  # this acquire's mark on the handle (`_begin`)
        try:
            owner = self._begin(mine)
            recorder = metrics.recorder
            started = None
            if recorder is not None:
                started = recorder.start(self, wait) if recorder.traces else time.monotonic()
            try:
                if wait <= 0:
                    result, sent = await self._aattempt(owner, None, self._plain(None))
                else:
                    result, sent = await self._await(owner, wait, delay)
            except BaseException as error:
                if recorder is not None:
                    self._failed(recorder, started, wait, error)
                raise
            if not self._finish(owner, result, sent):
                if recorder is not None:
                    self._refused(recorder, started, wait)
                if result.fence is not None:  # granted too late: give it back
                    undo, cancelled = await to_the_end(self._arelease_op(self.key, owner))
                    if not undo.cancelled():
                        undo.exception()  # read, not raised: it is past its ttl already
                    if cancelled is not None:
                        raise cancelled
                return False
            renewal = self._taken(recorder, started, wait, owner, sent)
            if renewal is not None:
                renewal.start_task()
            return True
        finally:
            if self._acquiring is mine:  # not another acquire's, refused by _begin
                self._acquiring = None

    async def _aattempt(
        self, owner: str, deadline: float | None, plain: bool, queued: bool = False
    ) -> tuple[AcquireResult, float]:
        """`_ask` for async code; if cancelled meanwhile, give back what it took, then
        re-raise."""
        store = self._store
        sent = time.monotonic()
        if plain and queued:
            call = store.aacquire_queued(self.key, owner, self.holder, self.ttl)
        elif plain:
            call = store.aacquire(self.key, owner, self.holder, self.ttl)
        else:
            wait = _writer_wait(deadline)
            call = store.aacquire_permit(self.key, owner, self.holder, self.ttl, self.mode, wait)
        future, cancelled = await to_the_end(call)
        if cancelled is not None:
            if not future.cancelled() and future.exception() is None and future.result().acquired:
                undo, _ = await to_the_end(self._arelease_op(self.key, owner))
                if undo.cancelled() or undo.exception() is not None:
                    logger.warning(
                        "lock %r was acquired as its waiter was cancelled and could not be given "
                        "back; it expires in %gs",
                        self.key,
                        self.ttl,
                    )
            raise cancelled
        result = future.result()
        return (result if result.held_as is None else self._checked(result)), sent

    async def _await(
        self, owner: str, timeout: float, retry_delay: float
    ) -> tuple[AcquireResult, float]:
        store = self._store
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # called from whichever thread saw the release
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the loop is closed; nobody is waiting any more
                pass

        deadline = time.monotonic() + timeout
        self._attempts = 1
        async with Turn.await_for(store, self.key, deadline) as mine:
            if not mine:  # ask the store once ourselves, as `_wait` does
                return await self._aattempt(owner, None, self._plain(None))
            # watch() starts the store's cross-process listener; the callback is how an
            # async waiter hears of releases: it cannot block on the Waiter's condition.
            queued = self._queued()
            leave = queued  # as in `_wait`: every way out but the lock or a store error
            try:
                with store.watch(self.key):
                    token = store.wake_board.add_callback(self.key, wake)
                    try:
                        last: AcquireResult | None = None
                        plain = True
                        self._attempts = 0
                        while True:
                            self._attempts += 1
                            woken.clear()  # before the attempt: a release right after counts
                            plain = self._plain(last, plain)
                            result, sent = await self._aattempt(owner, deadline, plain, queued)
                            left = deadline - time.monotonic()
                            if result.fence is not None or left <= 0:
                                leave = leave and result.fence is None
                                return result, sent
                            last = result
                            pause = self._pause(result, retry_delay, left, plain, queued)
                            if pause > 0:
                                with contextlib.suppress(TimeoutError):
                                    async with asyncio.timeout(pause):
                                        await woken.wait()
                    finally:
                        store.wake_board.remove_callback(token)
            except LockStoreUnavailable:
                leave = False
                raise
            finally:
                if leave:  # also cancelled while waiting or while an attempt was in flight
                    await self._aleave_queue(owner)

    # -- holding --------------------------------------------------------------------------
    def release(self) -> bool:
        """Free the lock if we still own it. False if it had expired or was taken over.

        On LockStoreUnavailable the handle keeps its owner, so release can be called again
        (the watchdog, if any, has stopped: the lock then lives until its ttl at most).
        """
        if not self._held or self.owner is None:
            return False
        self._stop_renewal()
        try:
            released = self._release_op(self.key, self.owner)
        except LockStoreUnavailable:
            self._store_error("release")
            raise
        return self._released(released)

    def _released(self, released: bool) -> bool:
        self._held = False
        if released:
            metered = self._metered
            if metered is not None:  # `_ended` written out: the hot path with metrics on
                if self.auto_extend:
                    self._ended("released", None)
                else:  # no watchdog: no other thread that could end it too
                    self._metered = None
                    recorder, since = metered
                    recorder.ended(self, self._meter, "released", time.monotonic() - since, None)
            _announce(signals.lock_released, lock=self)
        else:
            self._lost("release found the lock expired or taken over", cause="gone")
        return released

    def _ended(self, end: str, reason: str | None) -> None:
        """Tell the recorder that saw this acquisition how it ended, once: a release and the
        watchdog finding the lock lost may race."""
        with self._mutex:
            metered, self._metered = self._metered, None
        if metered is not None:
            recorder, since = metered
            recorder.ended(self, self._meter, end, time.monotonic() - since, reason)

    def _store_error(self, operation: str) -> None:
        metered = self._metered
        recorder = metrics.recorder if metered is None else metered[0]
        if recorder is not None:
            recorder.store_error(self, operation)

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lock live at least `ttl` more seconds (default: the lock's ttl).

        Raises LockNotHeldError if the lock was lost; the handle then no longer holds it.
        """
        seconds, owner = self._extend_args(ttl)
        sent = time.monotonic()
        try:
            extended = self.extend_op(self.key, owner, seconds)
        except LockStoreUnavailable:
            self._store_error("extend")
            raise
        self._extended(extended, sent + seconds)

    def _extend_args(self, ttl: Duration | None) -> tuple[float, str]:
        seconds = self.ttl if ttl is None else ttl_seconds(ttl)
        if not self._held or self.owner is None:
            why = "this handle does not hold it"
            if self.lost:
                why = f"it was lost ({self._lost_reason})"
            raise LockNotHeldError(f"cannot extend {self.key!r}: {why}")
        return seconds, self.owner

    def _extended(self, extended: bool, until: float) -> None:
        if extended:
            self._valid_until = max(self._valid_until, until)
            return
        self._held = False
        self._lost("extend found the lock expired or taken over", cause="gone")
        raise LockNotHeldError(
            f"cannot extend {self.key!r}: the lock expired or was taken over (fence {self.fence})"
        )

    # -- what the watchdog sees (watchdog.Renewable) -------------------------------------
    def confirmed_until(self) -> float:
        """Monotonic time of the last expiry the store confirmed (inf before any acquisition)."""
        return self._valid_until

    def renewed(self, owner: str, until: float) -> None:
        """The watchdog's extend for `owner` landed: the lock lives at least until `until`."""
        with self._mutex:
            if self._held and self.owner == owner:
                self._valid_until = max(self._valid_until, until)

    def renewal_lost(self, owner: str, reason: str, cause: str = "gone") -> None:
        """The watchdog found the acquisition of `owner` gone (`cause`, one of
        metrics.LOST_REASONS); ignored if it is not current."""
        if self._lost(reason, owner=owner, cause=cause):
            self._cancel_body()

    def count_renewal(self, outcome: str) -> None:
        """One watchdog extend came back as `outcome` (one of metrics.RENEWAL_OUTCOMES)."""
        metered = self._metered
        if metered is not None:
            metered[0].renewal(self, self._meter, outcome)

    def _lost(self, reason: str, owner: str | None = None, cause: str = "expired") -> bool:
        """Mark the current acquisition lost, once: `lost`, a WARNING, `lock_lost`, and the
        on_lost callable if there is one. True if this call was the one that found it.

        With `owner` (the watchdog reporting), only if that acquisition is still current.
        `cause` is the reason metrics show (metrics.LOST_REASONS): "gone" when the store no
        longer has it, which is an expiry once the ttl has run out by the handle's clock."""
        with self._mutex:
            if self.lost or (owner is not None and (owner != self.owner or not self._held)):
                return False
            self.lost, self._held, self._lost_reason = True, False, reason
            # Taken under the mutex: once it is released the handle may acquire again, and
            # that acquisition's watchdog is not ours to stop.
            renewal, self._renewal = self._renewal, None
            lost_owner = self.owner
        if renewal is not None:
            renewal.stop()
            if renewal.unanswered and lost_owner is not None:
                self._give_back(lost_owner)
        if self._metered is not None:
            if cause == "gone" and time.monotonic() >= self._valid_until:
                cause = "expired"
            self._ended("lost" if cause == "gone" else "expired", cause)
        logger.warning("lock %r (fence %s) was lost: %s", self.key, self.fence, reason)
        _announce(signals.lock_lost, lock=self, reason=reason)
        if callable(self.on_lost):
            self.on_lost(self)
        return True

    def _give_back(self, owner: str) -> None:
        """Release `owner` in the store, in the background: the lock was given up for lost by
        the handle's clock while a watchdog's extend had no answer, which the store may have
        made (its reply late or lost), keeping the lock a whole ttl more that `release()`
        (nothing held) would never free. A release of an owner that no longer holds is
        refused: harmless."""

        def done(future: Future[bool]) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                logger.info("lock %r: could not give back a lost acquisition (%s)", self.key, error)
            elif future.result():
                logger.info("lock %r: released the acquisition given up for lost", self.key)

        try:
            self._store.submit(self._release_op, self.key, owner).add_done_callback(done)
        except RuntimeError as error:  # the interpreter is shutting down: it expires
            logger.info("lock %r: could not give back a lost acquisition (%s)", self.key, error)

    def _cancel_body(self) -> None:
        """on_lost="raise": stop the async body that works under a lock it no longer holds
        (`_aleave` turns the cancellation into LockNotHeldError)."""
        body = self._body
        if body is None or self.on_lost != RAISE or body.done():
            return
        self._body_cancels += 1
        try:
            same_loop = asyncio.get_running_loop() is body.get_loop()
        except RuntimeError:
            same_loop = False
        if same_loop:
            body.cancel()
        else:
            body.get_loop().call_soon_threadsafe(body.cancel)

    def _loss_message(self) -> str:
        return f"lock {self.key!r} (fence {self.fence}) was lost while held: {self._lost_reason}"

    def _leave(self, error: BaseException | None) -> None:
        """End a block whose body ran (and raised `error`, or None): release, then, with
        on_lost="raise", raise LockNotHeldError if the lock was lost meanwhile. The body's
        own error wins; the loss is added to it as a note."""
        self.release()
        self._check_kept(error)

    def _check_kept(self, error: BaseException | None) -> None:
        if not self.lost or self.on_lost != RAISE:
            return
        if error is None:
            raise LockNotHeldError(self._loss_message())
        error.add_note(self._loss_message())

    def _watch_body(self) -> None:
        """An async block's body starts in this task: with the watchdog on and
        on_lost="raise", a loss cancels it."""
        if self.auto_extend and self.on_lost == RAISE:
            body = asyncio.current_task()
            self._body, self._body_cancels = body, 0
            self._body_pending = 0 if body is None else body.cancelling()

    async def _aleave(self, error: BaseException | None) -> None:
        """`_leave` for async blocks. A cancellation we made of the body (`_cancel_body`)
        becomes LockNotHeldError, as `asyncio.timeout` turns its own into TimeoutError; one
        from elsewhere stays a CancelledError. Each cancellation we made is taken back (a body
        that caught one and acquired again may be cancelled twice); the task may have been
        cancelled before the block began (cleanup under a lock at shutdown): those stay."""
        body, self._body = self._body, None
        ours, self._body_cancels = self._body_cancels, 0
        pending = others = self._body_pending
        if body is not None:
            for _ in range(ours):
                others = body.uncancel()
        await self.arelease()
        if ours and others <= pending and isinstance(error, asyncio.CancelledError):
            raise LockNotHeldError(self._loss_message()) from error
        self._check_kept(error)

    def _stop_renewal(self) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.stop()

    def is_owned(self) -> bool:
        """Does the store still have this handle's acquisition? One round trip: the check to
        make right before an irreversible side effect that cannot take a fence.

        False (and the lock counted lost) when the store forgot it, it expired or was taken
        over; raises LockStoreUnavailable when the store cannot say."""
        if not self._held or self.owner is None:
            return False
        if self.mode is EXCLUSIVE:
            return self._owned([self._store.get(self.key)])
        return self._owned(self._store.holders(self.key))

    def _owned(self, holders: Sequence[LockInfo | None]) -> bool:
        if any(info is not None and info.owner == self.owner for info in holders):
            return True
        self._lost("the store no longer has it", owner=self.owner, cause="gone")
        return False

    def ensure_held(self) -> None:
        """Raise LockNotHeldError unless this handle still holds its lock, as far as it knows.

        No store round trip: fails once released, lost, or past the last expiry confirmed."""
        if self._held and time.monotonic() >= self._valid_until:
            self._lost("its ttl ran out without a confirmed extend", owner=self.owner)
        if not self._held or self.owner is None:
            why = "it was lost" if self.lost else "this handle does not hold it"
            raise LockNotHeldError(f"lock {self.key!r} (fence {self.fence}) is not held: {why}")

    # -- holding, async -------------------------------------------------------------------
    async def arelease(self) -> bool:
        """`release` for async code; it completes even while the task is being cancelled.

        The cancellation is re-raised once the store has answered."""
        if not self._held or self.owner is None:
            return False
        self._stop_renewal()
        future, cancelled = await to_the_end(self._arelease_op(self.key, self.owner))
        if not future.cancelled() and isinstance(future.exception(), LockStoreUnavailable):
            self._store_error("release")
        if cancelled is not None:
            if future.cancelled() or future.exception() is not None:
                logger.warning(
                    "release of lock %r failed while its task was cancelled; it expires in at "
                    "most %gs",
                    self.key,
                    self.ttl,
                )
            else:
                try:
                    self._released(future.result())
                except Exception:  # the on_lost callable: the cancellation must not be lost
                    logger.exception(
                        "on_lost of lock %r raised as its task was cancelled", self.key
                    )
            raise cancelled
        return self._released(future.result())

    async def aextend(self, ttl: Duration | None = None) -> None:
        """`extend` for async code. Raises LockNotHeldError if the lock was lost.

        Cancelled meanwhile, it still records what the store did, then re-raises."""
        seconds, owner = self._extend_args(ttl)
        sent = time.monotonic()
        future, cancelled = await to_the_end(self.aextend_op(self.key, owner, seconds))
        if not future.cancelled() and isinstance(future.exception(), LockStoreUnavailable):
            self._store_error("extend")
        if cancelled is not None:
            if not future.cancelled() and future.exception() is None:
                try:
                    self._extended(future.result(), sent + seconds)
                except LockNotHeldError:
                    pass
                except Exception:  # the on_lost callable: the cancellation must not be lost
                    logger.exception(
                        "on_lost of lock %r raised as its task was cancelled", self.key
                    )
            raise cancelled
        self._extended(future.result(), sent + seconds)

    # -- inspection -----------------------------------------------------------------------
    def info(self) -> LockInfo | None:
        """The key's holder (ours or another's; with several, the one that expires first),
        or None if it is free."""
        info = self._store.get(self.key)
        if info is not None and info.is_gate:
            return _first(self._store.holders(self.key))
        return info

    def holders(self) -> list[LockInfo]:
        """Every current holder of the key (each permit, with its mode), soonest expiry
        first; [] when it is free."""
        return self._store.holders(self.key)

    def is_locked(self) -> bool:
        """Does anyone (not necessarily this handle) hold the key right now?"""
        return self._store.get(self.key) is not None

    def is_expired(self) -> bool:
        """True when this handle held the lock and lost it (expired, taken over, forgotten by
        the store); False before any acquisition and after a clean release."""
        if self.lost or not self._held:
            return self.lost
        return not self.is_owned()

    def remaining_time(self) -> float | None:
        """Seconds until the key, as it is held now, lets this handle in by expiries alone
        (what a Retry-After says), None when nobody holds it. A semaphore needs one permit
        freed: the soonest holder's expiry. A lock needs every holder gone (a writer waits for
        the last reader; a reader for the writer, or the readers ahead of a writer that
        waits): the latest expiry."""
        info = self._store.get(self.key)
        if info is None or not info.is_gate:
            return None if info is None else info.expires_in
        left = [holder.expires_in for holder in self._store.holders(self.key)]
        pick = min if self.mode.kind == "semaphore" else max
        return pick(left) if left else None

    async def ainfo(self) -> LockInfo | None:
        """`info` for async code: the key's (first) holder, or None if it is free."""
        info = await self._store.aget(self.key)
        if info is not None and info.is_gate:
            return _first(await self._store.aholders(self.key))
        return info

    async def aholders(self) -> list[LockInfo]:
        """`holders` for async code."""
        return await self._store.aholders(self.key)

    async def ais_locked(self) -> bool:
        """`is_locked` for async code: does anyone hold the key right now?"""
        return await self._store.aget(self.key) is not None

    async def ais_expired(self) -> bool:
        """`is_expired` for async code: this handle held the lock and lost it."""
        if self.lost or not self._held:
            return self.lost
        return not await self.ais_owned()

    async def ais_owned(self) -> bool:
        """`is_owned` for async code: does the store still have this handle's acquisition?"""
        if not self._held or self.owner is None:
            return False
        if self.mode is EXCLUSIVE:
            return self._owned([await self._store.aget(self.key)])
        return self._owned(await self._store.aholders(self.key))

    async def aremaining_time(self) -> float | None:
        """`remaining_time` for async code: seconds until the key lets this handle in, or None."""
        info = await self._store.aget(self.key)
        if info is None or not info.is_gate:
            return None if info is None else info.expires_in
        left = [holder.expires_in for holder in await self._store.aholders(self.key)]
        pick = min if self.mode.kind == "semaphore" else max
        return pick(left) if left else None

    @property
    def held(self) -> bool:
        """Whether this handle believes it holds the lock: acquired, not released, not lost,
        and its last confirmed expiry not passed (no store round trip)."""
        return self._held and time.monotonic() < self._valid_until

    @property
    def store(self) -> LockStore:
        return self._store

    # -- running --------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]:
        """Acquire, call `fn()`, always release. `(False, None)` and fn not called if not
        acquired within `timeout`; store failures raise LockStoreUnavailable."""
        if not self.acquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        try:
            value = fn()
        except BaseException as error:
            self._leave(error)
            raise
        self._leave(None)
        return LockOutcome(True, value)

    def run_immediately(self, fn: Callable[[], T]) -> LockOutcome[T]:
        """`run` that never waits: fn runs only if the lock is free right now."""
        return self.run(fn, timeout=0)

    # -- running, async ------------------------------------------------------------------
    @overload
    async def arun(  # type: ignore[overload-overlap]
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    @overload
    async def arun(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    async def arun(
        self,
        fn: Callable[[], Any],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[Any]:
        """`run` for async code: `fn` is an async callable, or a sync one run in a thread.

        The release completes even on cancellation; a sync fn cannot be interrupted, so on
        cancellation the lock is kept until it returns, then released, then the cancel raised."""
        if not await self.aacquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        self._watch_body()
        try:
            value = await _call(fn)
        except BaseException as error:
            await self._aleave(error)
            raise
        await self._aleave(None)
        return LockOutcome(True, value)

    async def __aenter__(self) -> Lock:
        raises, self._raises = self._raises, True  # a refusal here raises: traces say so
        try:
            acquired = await self.aacquire()
        finally:
            self._raises = raises
        if not acquired:
            raise self.unavailable()
        self._watch_body()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._aleave(exc)

    def unavailable(self, prefix: str = "") -> LockUnavailable:
        """The error saying this handle was not acquired in its timeout (after `prefix`,
        such as "report not run: "): every surface that raises it words it so."""
        if self.mode.kind == "semaphore":
            why = f"has no free permit (limit {self.mode.limit})"
        else:
            why = "is held by someone else"
        return LockUnavailable(
            self.key, f"{prefix}{self.describe()} {why} (waited {self.timeout:g}s)"
        )

    def describe(self) -> str:
        """ "lock 'key'", "shared lock 'key'" or "semaphore 'key'": for messages."""
        return f"{_kind_phrase(self.mode.kind, article=False)} {self.key!r}"

    def __enter__(self) -> Lock:
        raises, self._raises = self._raises, True  # a refusal here raises: traces say so
        try:
            acquired = self.acquire()
        finally:
            self._raises = raises
        if not acquired:
            raise self.unavailable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave(exc)

    # -- handing over ---------------------------------------------------------------------
    def serialize(self) -> str:
        """A signed token another process can pass to `restore_lock` to extend or release."""
        if self.owner is None or self.fence is None or not self._held:
            raise LockNotHeldError(f"cannot serialize {self.key!r}: this handle does not hold it")
        # The deadline travels as wall-clock time: monotonic clocks mean nothing in another
        # process. Clock skew between the two machines shifts it; the store stays the judge.
        expires_at = time.time() + (self._valid_until - time.monotonic())
        mode = self.mode
        token = tokens.Token(
            self.key,
            self.ttl,
            self.owner,
            self.fence,
            self.holder,
            self.store_alias,
            expires_at,
            None if mode is EXCLUSIVE else (mode.limit if mode.kind == "semaphore" else "shared"),
        )
        return tokens.dumps(token)

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "not held"
        mode = "" if self.mode is EXCLUSIVE else f" {self.mode}"
        return f"<Lock {self.key!r}{mode} store={self.store_alias!r} {state}>"


make_handles_with(Lock.from_spec)


class LockOutcome(NamedTuple, Generic[T]):
    """What `Lock.run` did: `acquired` is False when fn was not called (then `value` is None)."""

    acquired: bool
    value: T | None


def _left(deadline: float | None) -> float:
    """Seconds until `deadline` (monotonic), 0 for None or past."""
    return 0.0 if deadline is None else max(0.0, deadline - time.monotonic())


def _writer_wait(deadline: float | None) -> float:
    """How long a writer's mark, set by an attempt now, keeps readers out: until `deadline`,
    for QUEUE_LEASE at most. The writer renews it with each attempt; one that was cancelled,
    failed or died no longer keeps readers out of a key a moment later."""
    return min(_left(deadline), QUEUE_LEASE)


def _kind_phrase(kind: str, *, article: bool = True) -> str:
    phrase = {"exclusive": "lock", "shared": "shared lock", "semaphore": "semaphore"}[kind]
    if not article:
        return phrase
    return f"a {phrase}" if kind != "exclusive" else "an exclusive lock"


def _first(holders: list[LockInfo]) -> LockInfo | None:
    """The holder that expires first (the store lists them so), None if there is none."""
    return holders[0] if holders else None


def _announce(signal: Signal, **kwargs: Any) -> None:
    """Send one of our signals. A receiver that raises is logged (by Django, logger
    "django.dispatch"), not propagated: it must not strand an acquired lock nor cut a release
    short. Every acquire and release passes here: with no receivers it costs one test."""
    if signal.receivers:
        signal.send_robust(sender=Lock, **kwargs)


def lock(key: str, *, shared: bool = False, **options: Unpack[HandleOptions]) -> Lock:
    """A handle on `key` in `store`; nothing is acquired until acquire/run/`with`. It takes
    the `LockOptions` (see there what each means) but `limit` (that is `semaphore()`).

    `shared=True` makes it a shared (read) lock: any number of shared holders at once, no
    exclusive one meanwhile; an exclusive acquirer that waits keeps new shared ones out, so
    readers cannot starve it.

    `auto_extend=True` keeps the lock alive while held (extending every ttl/3), for at most
    `max_hold` seconds in all if given. `on_lost` says what happens when the lock is lost while
    held: "raise" (leaving `with`/`run` raises LockNotHeldError), "warn" (log only), or a
    callable `(lock) -> None` called once when the loss is found.

    `name` is what metrics and traces call the lock ("invoice" for "invoice:42"); without
    it they show the key with its digits, UUIDs and long hex as `*`."""
    if "limit" in options:
        raise refuse_option("lock", "limit", "for at most N holders use semaphore(key, limit=N)")
    # The options as given (a new handle per `with lock(key):` is the usual way: no copy).
    given: Mapping[str, object] = options if shared is False else {**options, "shared": shared}
    return Lock.from_spec(key, LockSpec.of("lock", given))


def semaphore(key: str, *, limit: int, **options: Unpack[HandleOptions]) -> Lock:
    """A handle on the semaphore `key`: at most `limit` holders at once, each with a permit
    of its own (owner, fence, ttl), so one that crashes frees only its own place, at its ttl.

    The same API and `LockOptions` as `lock()` (`name` too), `limit` in place of `shared`.
    Each acquire counts the live permits against the `limit` it was given: every caller of
    one key should pass the same limit."""
    if limit is None:
        raise TypeError("semaphore() needs limit=, the most holders at once (an int >= 1)")
    if "shared" in options:
        raise refuse_option(
            "semaphore",
            "shared",
            "a semaphore's permits are alike; for readers and writers use lock(key, shared=True)",
        )
    return Lock.from_spec(key, LockSpec.parse("semaphore", limit=limit, **options))


async def _call(fn: Callable[[], Any]) -> Any:
    """Call `fn` from async code: await it if async, else run it in a worker thread.

    A thread cannot be interrupted: if cancelled meanwhile, wait for it, then re-raise."""
    if iscoroutinefunction(fn):
        return await fn()
    future, cancelled = await to_the_end(sync_to_async(fn, thread_sensitive=False)())
    if cancelled is not None:
        raise cancelled
    value = future.result()
    if inspect.isawaitable(value):  # lambda: some_coroutine(...)
        value = await value
    return value


def restore_lock(token: str) -> Lock:
    """The handle `Lock.serialize` described, holding the same acquisition (same owner, fence).

    Raises InvalidLockToken for garbage, truncated, tampered or foreign tokens.
    """
    data = tokens.loads(token)
    mode = data.mode
    handle = Lock(
        data.key,
        ttl=data.ttl,
        store=data.store,
        holder=data.holder,
        limit=mode if isinstance(mode, int) else None,
        shared=mode == "shared",
    )
    handle.owner, handle.fence, handle._held = data.owner, data.fence, True
    # The lock lives as long as it had left when serialized, no longer (a token from before
    # tokens carried it: a whole ttl from now, as then).
    left = data.ttl if data.expires_at is None else data.expires_at - time.time()
    handle._valid_until = time.monotonic() + left
    return handle


def force_release(
    key: str, *, store: str = "default", user: object | None = None, fence: int | None = None
) -> LockInfo | None:
    """Free `key` in the store `store` whoever holds it; the lock that was freed, or None.
    With `fence`, only that acquisition: one taken over since (say, while a person was asked
    to confirm) is left alone.

    `manage.py locks release` and the admin both release through here: it logs a WARNING when
    it frees a lock and always sends `lock_force_released` (info=None: nothing was held).
    """
    lock_store = get_lock_store(check_store(store))
    validate_key(key, lock_store)
    info = lock_store.force_release(key, fence)
    if info is not None:
        logger.warning(
            "lock %r in store %r (holder %s, fence %s) was force-released by %s",
            key,
            store,
            info.holder,
            info.fence,
            user if user is not None else "a script",
        )
    recorder = metrics.recorder
    if info is not None and recorder is not None:
        held = None
        if info.acquired_at is not None:
            held = max(0.0, (datetime.now(UTC) - info.acquired_at).total_seconds())
        recorder.forced(store, lock_name(key), held)
    _announce(signals.lock_force_released, key=key, store=store, info=info, user=user)
    return info
