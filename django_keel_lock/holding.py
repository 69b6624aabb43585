"""What a handle does with the acquisition it holds: release it, extend it, keep it alive
with the watchdog (`watchdog.Renewable`), find it lost, and check it is still owned.

`Holding` is the part of `core.Lock` that works on a taken acquisition (the owner, fence and
last confirmed expiry the acquire left on the handle); the acquire itself is the engine's
(`engine`, `drivers`), and what the store says of the key is `queries.KeyQueries`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast

from django.dispatch import Signal

from . import drivers, engine, metrics, signals, watchdog
from .durations import Duration
from .exceptions import LockNotHeldError, LockStoreUnavailable
from .options import RAISE, OnLost, ttl_seconds
from .stores.base import EXCLUSIVE, LockInfo, LockStore, Mode

if TYPE_CHECKING:
    from .core import Lock

__all__ = ["Holding"]

logger = logging.getLogger("django_keel_lock")


class Holding:
    """Releasing, extending, renewing and losing the acquisition a handle holds: a part of
    `core.Lock`, whose slots keep the state (its methods take `self`)."""

    # The acquisition's state that only this part writes (`core.Lock` keeps the rest).
    __slots__ = ("_body", "_held", "_lost_reason", "_renewal", "_valid_until", "lost")

    key: str
    #: True for a multi-key lock (`multi.MultiLock`), whose store operations take `keys`.
    many: ClassVar[bool] = False
    #: Exclusive and of one key (`engine.Target.plain`): the store's plain `release` frees it.
    plain: bool
    holder: str
    ttl: float
    mode: Mode
    owner: str | None
    fence: int | None
    on_lost: OnLost
    auto_extend: bool
    max_hold: float | None
    _store: LockStore
    #: Guards the state the watchdog shares (a no-op without one: `core.Lock._setup`).
    _mutex: AbstractContextManager[object]
    _meter: metrics.Meter | None
    _held: bool
    _valid_until: float
    #: True once this acquisition is known lost (expired, taken over, store unreachable).
    lost: bool
    _lost_reason: str
    _renewal: watchdog.Renewal | None
    # The async block's body, cancelled when the watchdog finds the lock lost
    # (on_lost="raise" with auto_extend).
    _body: drivers.Body | None

    def _announce(self, signal: Signal, **kwargs: Any) -> None:
        raise NotImplementedError  # `core.Lock`'s: its signals' sender is the Lock class

    @property
    def store(self) -> LockStore:
        return self._store

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys this handle takes: its one key (a multi-key lock's several)."""
        return (self.key,)

    @property
    def _handle(self) -> Lock:
        """This handle, as what it is: the `core.Lock` that signals and metrics are told of."""
        return cast("Lock", self)

    def release(self) -> bool:
        """Free the lock if we still own it. False if it had expired or was taken over.

        On LockStoreUnavailable the handle keeps its owner, so release can be called again
        (the watchdog, if any, has stopped: the lock then lives until its ttl at most).
        """
        if not self._held or self.owner is None:
            return False
        if self._renewal is not None:
            self._stop_renewal()
        try:  # `engine.release_call` written out: a call less on the hot path
            if self.plain:  # exclusive, one key
                released = self._store.release(self.key, self.owner)
            else:
                released = drivers.call(self._store, engine.release_call(self, self.owner))
        except LockStoreUnavailable:
            self._store_error("release")
            raise
        if released and self._meter is None and not signals.lock_released.receivers:
            self._held = False  # `_released` in short: released, and nobody to tell
            return True
        return self._released(released)

    def release_with(self, operation: Callable[[str, str], bool | None]) -> bool | None:
        """`release` through another store operation, `operation(key, owner)`, which does
        something else in the same round trip and may release this exclusive acquisition:
        True if it released it, False if it found it gone (as `release` says), None if it
        left it held. The handle then ends as `release` (or holding on) leaves it: signals,
        metrics and wake-ups alike. None (and nothing called) when nothing is held.

        Not with `auto_extend`: a renewal would race the operation's release. (A capped
        grant's confirmation still pending, `Lock._cap`, is stopped first, as `release`
        stops it, and sent again when the operation left the lock held.)"""
        if not self._held or self.owner is None:
            return None
        if self.auto_extend or self.mode is not EXCLUSIVE:
            raise ValueError(
                f"release_with releases an exclusive lock without auto_extend; {self.key!r} "
                "is not one: call release() instead"
            )
        pending = self._renewal
        if pending is not None:
            self._stop_renewal()
        try:
            released = operation(self.key, self.owner)
        except LockStoreUnavailable:
            self._store_error("release")
            raise
        if released is not None:
            return self._released(released)
        again = None if pending is None else pending.again()
        if again is not None:  # still held, still to confirm
            self._renewal = again
            again.confirm()
        return None

    def _released(self, released: bool) -> bool:
        self._held = False
        if released:
            meter = self._meter
            if meter is not None:  # a watchdog's or a confirmation's thread may end it too
                meter.ended(self._handle, "released", None, self._mutex)
            if signals.lock_released.receivers:  # `_announce`'s test first: a call less
                self._announce(signals.lock_released, lock=self)
        else:
            self._lost("release found the lock expired or taken over", cause="gone")
        return released

    def _store_error(self, operation: str) -> None:
        metrics.store_error(self._meter, self._handle, operation)

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lock live at least `ttl` more seconds (default: the lock's ttl).

        Raises LockNotHeldError if the lock was lost; the handle then no longer holds it.
        """
        seconds, owner = self._extend_args(ttl)
        sent = time.monotonic()
        try:
            extended = self.extend_op(owner, seconds)
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

    @property
    def extend_op(self) -> Callable[[str, float], bool]:
        """The store operation that extends this handle's acquisition (the watchdog's), for
        its key (or keys): called with the owner and the seconds."""
        return partial(getattr(self._store, engine.extend_op(self)), engine.subject(self))

    @property
    def aextend_op(self) -> Callable[[str, float], Awaitable[bool]]:
        """`extend_op` for async code."""
        return partial(getattr(self._store, "a" + engine.extend_op(self)), engine.subject(self))

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
        body = self._body
        if self._lost(reason, owner=owner, cause=cause) and body is not None:
            body.cancel()  # `_aleave` turns it into LockNotHeldError

    def count_renewal(self, outcome: str) -> None:
        """One watchdog extend came back as `outcome` (one of metrics.RENEWAL_OUTCOMES)."""
        if self._meter is not None:
            self._meter.renewed(self._handle, outcome)

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
        # An extend the store may have made (its reply late or lost) keeps the lock a whole
        # ttl more that `release()` (nothing held) would never free; a multi-key lock that
        # lost one key still holds the others.
        give_back = self.many
        if renewal is not None:
            renewal.stop()
            give_back = give_back or renewal.unanswered
        if give_back and lost_owner is not None:
            drivers.give_back_later(self._store, engine.give_back(self, lost_owner))
        if self._meter is not None:
            if cause == "gone" and time.monotonic() >= self._valid_until:
                cause = "expired"
            end = "lost" if cause == "gone" else "expired"
            self._meter.ended(self._handle, end, cause, self._mutex)
        logger.warning("lock %r (fence %s) was lost: %s", self.key, self.fence, reason)
        self._announce(signals.lock_lost, lock=self, reason=reason)
        if callable(self.on_lost):
            self.on_lost(self._handle)
        return True

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
            self._body = drivers.Body.current()

    async def _aleave(self, error: BaseException | None) -> None:
        """`_leave` for async blocks: a cancellation we made of the body becomes
        LockNotHeldError (`drivers.Body.ended`); one from elsewhere stays a CancelledError."""
        body, self._body = self._body, None
        ours = body is not None and body.ended(error)
        await self.arelease()
        if ours:
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
            return self._owned([self._store.get(key) for key in self.keys])
        return self._owned(self._store.holders(self.key))

    def _owned(self, holders: Sequence[LockInfo | None]) -> bool:
        """Whether `holders` (each key's lock, or the key's permits) show this acquisition
        on every key; if not, it is lost."""
        owner = self.owner
        if sum(info is not None and info.owner == owner for info in holders) >= len(self.keys):
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

    async def arelease(self) -> bool:
        """`release` for async code; it completes even while the task is being cancelled.

        The cancellation is re-raised once the store has answered."""
        if not self._held or self.owner is None:
            return False
        self._stop_renewal()
        return await drivers.asettle(
            self._store,
            engine.release_call(self, self.owner),
            self._released,
            lambda: self._store_error("release"),
            f"release of lock {self.key!r} failed while its task was cancelled; it expires in "
            f"at most {self.ttl:g}s",
        )

    async def aextend(self, ttl: Duration | None = None) -> None:
        """`extend` for async code. Raises LockNotHeldError if the lock was lost.

        Cancelled meanwhile, it still records what the store did, then re-raises."""
        seconds, owner = self._extend_args(ttl)
        until = time.monotonic() + seconds
        await drivers.asettle(
            self._store,
            engine.extend_call(self, owner, seconds),
            lambda extended: self._extended(extended, until),
            lambda: self._store_error("extend"),
        )

    def is_expired(self) -> bool:
        """True when this handle held the lock and lost it (expired, taken over, forgotten by
        the store); False before any acquisition and after a clean release."""
        if self.lost or not self._held:
            return self.lost
        return not self.is_owned()

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
            return self._owned([await self._store.aget(key) for key in self.keys])
        return self._owned(await self._store.aholders(self.key))

    @property
    def held(self) -> bool:
        """Whether this handle believes it holds the lock: acquired, not released, not lost,
        and its last confirmed expiry not passed (no store round trip)."""
        return self._held and time.monotonic() < self._valid_until
