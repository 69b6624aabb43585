"""Keeps `auto_extend` locks alive while their holder works, and notices when one is lost.

A sync acquisition gets a thread of its own, an async one a task on its event loop; both run
the same `Renewal` plan: extend every ttl/3 (owner-checked by the store), never past
`max_hold`, and report the lock lost when an extend finds it gone or no extend has been
confirmed before the last confirmed expiry. Neither holds a strong reference to the handle, so
dropping the handle stops the renewals; releasing it stops them first.

Why a thread per lock rather than one scheduler thread: an extend stuck on one store (a
network partition can hang a connect for minutes) cannot delay another lock's renewal, and
stopping is one `Event.set`. The thread only waits: its store calls run on the store's own
worker threads (`LockStore.submit`), so threads coming and going leave no connections behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .stores.base import LockStore

logger = logging.getLogger("django_keel_lock")

#: Extend tasks still running after their watchdog moved on (asyncio keeps only weak refs).
_pending: set[asyncio.Future[bool]] = set()


def _forget(task: asyncio.Future[bool]) -> None:
    _pending.discard(task)
    if not task.cancelled():
        task.exception()  # read it, so asyncio does not log "exception was never retrieved"


class Renewable(Protocol):
    """What a `Renewal` needs of the handle it keeps alive (`core.Lock` implements it)."""

    @property
    def key(self) -> str: ...

    @property
    def ttl(self) -> float: ...

    @property
    def max_hold(self) -> float | None: ...

    @property
    def store(self) -> LockStore: ...

    @property
    def extend_op(self) -> Callable[[str, float], bool]:
        """The store operation that extends the acquisition (a lock's, a permit's, a
        multi-key lock's), called with the owner and the seconds."""
        ...

    @property
    def aextend_op(self) -> Callable[[str, float], Awaitable[bool]]: ...

    def confirmed_until(self) -> float:
        """Monotonic time of the last expiry the store confirmed for the current acquisition."""
        ...

    def renewed(self, owner: str, until: float) -> None:
        """An extend for `owner` landed: the lock lives at least until `until` (monotonic)."""
        ...

    def renewal_lost(self, owner: str, reason: str, cause: str = "gone") -> None:
        """The acquisition of `owner` is gone, for `reason` (ignored if no longer current);
        `cause` is the word metrics show (metrics.LOST_REASONS)."""
        ...

    def count_renewal(self, outcome: str) -> None:
        """One extend came back as `outcome` (metrics.RENEWAL_OUTCOMES), for the metrics."""
        ...


class Renewal:
    """The renewal plan of one acquisition, shared by the sync thread and the async task.

    `owner` is the acquisition's owner token, `started` the monotonic time its acquire was
    sent (what `max_hold` counts from). Start it with `start_thread` or `start_task`.
    """

    def __init__(
        self,
        handle: Renewable,
        owner: str,
        started: float,
        *,
        confirm: bool = False,
        once: bool = False,
    ) -> None:
        self._handle = weakref.ref(handle)
        self.store = handle.store
        self.extend, self.aextend = handle.extend_op, handle.aextend_op
        self.key, self.owner, self.ttl = handle.key, owner, handle.ttl
        self.max_hold = handle.max_hold
        self.interval = handle.ttl / 3
        #: The first extend's pause: none to `confirm` a capped grant (`Lock._cap`), which
        #: is sure for less than its ttl until an extend answers.
        self.first = 0.0 if confirm else self.interval
        #: One extend answered is all (a capped grant's confirmation, without auto_extend).
        self.once = once
        # While the store fails: try again soon, but not in a tight loop.
        self.retry = max(0.05, min(handle.ttl / 10, 1.0))
        self.started = started
        self.cap = None if self.max_hold is None else started + self.max_hold
        self.stopped = False
        #: An extend was sent and its answer has not been taken in (in flight, or failed: its
        #: reply late or lost). The store may have made it, and keep the lock a ttl from
        #: then, past the expiry the handle counts on; a lock given up for lost meanwhile is
        #: given back (`Lock._lost`).
        self.unanswered = False
        self._kick = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finalizer = weakref.finalize(handle, self.stop)

    def start_thread(self) -> None:
        """Renew from a daemon thread (sync holders)."""
        thread = threading.Thread(
            target=self._run_thread, name=f"keel-lock-watchdog:{self.key[:40]}", daemon=True
        )
        thread.start()

    def start_task(self) -> None:
        """Renew from a task on the running event loop (async holders)."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(
            self._run_task(), name=f"keel-lock-watchdog:{self.key[:40]}"
        )

    def confirm(self) -> None:
        """Send one extend now on the store's worker threads, and settle it there (a capped
        grant's confirmation, `once`, for a handle without a watchdog): no thread or task of
        its own. A store error tries again after `settle`'s pause, while the lock lives."""
        due = None if self.stopped else self.due()
        if due is None:
            return
        seconds, sent = due
        try:
            future = self.store.submit(self.extend, self.owner, seconds)
        except RuntimeError as error:  # the interpreter is shutting down
            self.settle(error, seconds, sent)
            return
        future.add_done_callback(lambda done: self._confirmed(done, seconds, sent))

    def again(self) -> Renewal | None:
        """A new confirmation like this stopped one (`confirm` it), for the same acquisition;
        None when the handle is gone."""
        handle = self._handle()
        if handle is None:
            return None
        return Renewal(handle, self.owner, self.started, confirm=True, once=self.once)

    def _confirmed(self, future: Future[bool], seconds: float, sent: float) -> None:
        outcome: bool | BaseException | None = None
        if not future.cancelled():
            outcome = future.exception() or future.result()
        pause = self.settle(outcome, seconds, sent)
        if pause is not None and not self.stopped:  # the store failed: again, shortly
            retry = threading.Timer(pause, self.confirm)
            retry.daemon = True
            retry.start()

    def stop(self) -> None:
        """Stop renewing now (release, loss, or the handle was garbage-collected).

        Safe from any thread and idempotent; an extend already sent is left to finish."""
        self.stopped = True
        self._finalizer.detach()
        self._kick.set()
        task, loop = self._task, self._loop
        if task is not None and loop is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop is closed, and the task with it
                pass

    # -- the plan -------------------------------------------------------------------------
    def time_left(self) -> float:
        """Seconds until the last expiry the store confirmed (0 when the handle is gone)."""
        handle = self._handle()
        return 0.0 if handle is None else max(0.0, handle.confirmed_until() - time.monotonic())

    def extension(self) -> float | None:
        """How many seconds to extend by now; None when `max_hold` allows no more."""
        if self.cap is None:
            return self.ttl
        now = time.monotonic()
        seconds = min(self.ttl, self.cap - now)
        handle = self._handle()
        if handle is None or now + seconds <= handle.confirmed_until():
            return None  # an extend would not push the expiry out any more
        return seconds

    def due(self) -> tuple[float, float] | None:
        """The extend to send now: how many seconds, and when it is sent (it is `unanswered`
        until `settle`); None when `max_hold` allows no more (`capped` says what then)."""
        seconds = self.extension()
        if seconds is None:
            return None
        self.unanswered = True
        return seconds, time.monotonic()

    def capped(self) -> float | None:
        """`max_hold` reached: the pause until the lock runs out, then (None) report it lost."""
        left = self.time_left()
        if left > 0:
            return left
        self._report_lost(f"max_hold of {self.max_hold:g}s reached; the lock expired", "max_hold")
        return None

    def settle(
        self, outcome: bool | BaseException | None, seconds: float, sent: float
    ) -> float | None:
        """Apply one extend's outcome (None: no answer by the deadline). The pause before the
        next step, or None to stop."""
        handle = self._handle()
        if handle is None or self.stopped:
            return None
        self.unanswered = not isinstance(outcome, bool)
        if outcome is True:
            handle.count_renewal("extended")
            handle.renewed(self.owner, sent + seconds)
            return None if self.once else self.interval
        if outcome is False:
            handle.count_renewal("lost")
            self._report_lost("the watchdog's extend found the lock expired or taken over", "gone")
            return None
        handle.count_renewal("error")
        left = self.time_left()
        why = "no answer" if outcome is None else f"{type(outcome).__name__}: {outcome}"
        if left <= 0:
            self._report_lost(
                f"the store did not confirm an extend before the ttl ran out ({why})",
                "unreachable",
            )
            return None
        logger.info("could not extend lock %r (%s); retrying, %.1fs left", self.key, why, left)
        return min(self.retry, left)

    def _report_lost(self, reason: str, cause: str) -> None:
        handle = self._handle()
        if handle is not None and not self.stopped:
            try:
                handle.renewal_lost(self.owner, reason, cause)
            except Exception:  # the holder's on_lost callable: nobody here to raise to
                logger.exception("on_lost of lock %r raised", self.key)

    # -- sync -----------------------------------------------------------------------------
    def _wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` or until kicked; True once stopped."""
        self._kick.wait(timeout)
        self._kick.clear()
        return self.stopped

    def _run_thread(self) -> None:
        pause: float | None = self.first
        while pause is not None and not self._wait(pause):
            due = self.due()
            if due is None:
                pause = self.capped()
                continue
            seconds, sent = due
            future = self.store.submit(self.extend, self.owner, seconds)
            future.add_done_callback(lambda _: self._kick.set())
            # Wait for the answer, but no longer than the lock is known to live.
            deadline = sent + self.time_left()
            while not future.done() and not self.stopped and time.monotonic() < deadline:
                self._wait(max(0.0, deadline - time.monotonic()))
            if self.stopped:
                return
            outcome: bool | BaseException | None = None
            if future.done():
                outcome = future.exception() or future.result()
            pause = self.settle(outcome, seconds, sent)

    # -- async ----------------------------------------------------------------------------
    async def _run_task(self) -> None:
        pause: float | None = self.first
        while pause is not None:
            await asyncio.sleep(pause)
            if self.stopped:
                return
            due = self.due()
            if due is None:
                pause = self.capped()
                continue
            seconds, sent = due
            task = asyncio.ensure_future(self.aextend(self.owner, seconds))
            _pending.add(task)
            task.add_done_callback(_forget)
            done, _ = await asyncio.wait({task}, timeout=self.time_left())
            outcome: bool | BaseException | None = None
            if done:
                if task.cancelled():
                    return
                outcome = task.exception() or task.result()
            pause = self.settle(outcome, seconds, sent)
