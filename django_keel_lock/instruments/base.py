"""What a metrics backend receives from the core (`Recorder`) and the words it may show.

Kept apart from `metrics` (which loads the backends) so that a backend imports nothing that
imports it back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core import Lock

__all__ = ["ACQUIRE_OUTCOMES", "ENDS", "LOST_REASONS", "RENEWAL_OUTCOMES", "Recorder"]

#: How an acquire ended: taken; found held and not waited for (timeout 0); waited for and
#: given up; the store failed (LockStoreUnavailable).
ACQUIRE_OUTCOMES = ("acquired", "contended", "timeout", "error")
#: How a held acquisition ended: released by its holder; found gone from the store while its
#: ttl had time left (taken over, forced free, forgotten); run out of its ttl; forced free
#: (counted by the process that forced it: `force_release`, `manage.py locks release`, admin).
ENDS = ("released", "lost", "expired", "forced")
#: Why a lock was lost: its ttl ran out with no extend confirmed; the store no longer had it;
#: the watchdog reached max_hold; the watchdog could not reach the store before the ttl ran out.
LOST_REASONS = ("expired", "gone", "max_hold", "unreachable")
#: A watchdog extend: confirmed; it found the lock gone; no answer or a store error.
RENEWAL_OUTCOMES = ("extended", "lost", "error")


class Recorder:
    """Receives what the core does with locks; a backend overrides what it shows.

    Everything a backend needs comes as arguments or through the handle's public attributes
    (`name`, `store_alias`, `ttl`, `fence`, `on_lost`, `describe()`); a backend never reads or
    writes a handle's private state.

    `start` returns what the backend needs to finish the acquire (a span): the core passes
    it back to exactly one of `acquired`, `refused` and `failed`. A backend without `traces`
    is passed the monotonic time the acquire began instead: one call less on the hot path.

    `kept` is the backend's own state on one handle: what its last `acquired`, `refused` or
    `failed` on that handle returned (None at first), which the core keeps without reading it
    and hands back to those three and to `ended` and `renewal` (what `acquired` returned, for
    the acquisition it began). It may come from another backend (the setting changed): a
    backend's `kept` starts with the backend itself, so that it can tell its own."""

    #: Whether the core calls `start` (else `started` is the time the acquire began).
    traces = True

    def start(self, handle: Lock, timeout: float) -> Any:
        return time.monotonic()

    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        """The acquire that `start` began took the lock (`handle.fence` is its fence) after
        `attempts` calls to the store; returns the `kept` of this handle from now on."""
        return kept

    def refused(
        self, handle: Lock, started: Any, outcome: str, attempts: int, raises: bool, kept: Any
    ) -> Any:
        """It did not: `outcome` is "contended" or "timeout"; `raises`: the caller raises
        LockUnavailable for it. Returns the `kept` of this handle from now on."""
        return kept

    def failed(
        self, handle: Lock, started: Any, error: BaseException, attempts: int, kept: Any
    ) -> Any:
        """It raised `error` (LockStoreUnavailable: the store failed). Returns the `kept` of
        this handle from now on."""
        return kept

    def ended(self, handle: Lock, kept: Any, end: str, seconds: float, reason: str | None) -> None:
        """The acquisition held for `seconds` ended as `end` (one of ENDS); `reason` (one of
        LOST_REASONS) when it was lost or expired. Called once per acquisition, maybe from the
        watchdog's thread."""

    def renewal(self, handle: Lock, kept: Any, outcome: str) -> None:
        """One watchdog extend of `handle`'s acquisition came back as `outcome`."""

    def store_error(self, handle: Lock, operation: str) -> None:
        """`operation` ("release", "extend") failed with LockStoreUnavailable."""

    def forced(self, store: str, name: str, seconds: float | None) -> None:
        """`force_release` freed a lock of `name` held for `seconds` (None: unknown)."""
