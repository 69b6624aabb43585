"""OpenTelemetry spans, events and metrics of locks (`KEEL_LOCK_METRICS = "otel"`).

Needs `opentelemetry-api` only; what is exported, and where, is the application's SDK set-up.

- An INTERNAL span `lock.acquire <name>` around each acquire, current while it runs (so the
  CLIENT spans a driver's instrumentation makes for the store's calls nest under it; the
  Redis store's sync scripts and PostgreSQL's libpq path make none: docs/surfaces/metrics.md),
  with the attributes keel.lock.store, .name, .ttl, .timeout, .attempts, .outcome and .fence.
- Span events `lock.acquired`, `lock.released` and `lock.lost` on the span that was current
  when the acquire began (the caller's), even when the watchdog finds the loss.
- `error.type`: on the acquire span when the store failed (the exception's class) or when a
  refusal raises (LockUnavailable: `with lock(...)`, `@locked`, `locked_task` with
  on_locked="raise"); on the caller's span when a lock is lost and on_lost="raise" makes the
  block raise (LockNotHeldError). A skip, a 409 or a retry is handled: not an error.
- Metrics keel.lock.acquire.duration and keel.lock.hold.duration (histograms, seconds) and
  keel.lock.lost (a counter), with keel.lock.store, keel.lock.name and the outcome, end or
  reason.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context, metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from ..exceptions import LockStoreUnavailable
from ..version import __version__
from .base import Recorder

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ..core import Lock

__all__ = ["OtelRecorder"]

SCOPE = "django_keel_lock"


class OtelRecorder(Recorder):
    """Traces and measures each acquisition (see the module docstring)."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer(SCOPE, __version__)
        meter = metrics.get_meter(SCOPE, __version__)
        self.acquire_duration = meter.create_histogram(
            "keel.lock.acquire.duration", unit="s", description="How long acquiring a lock took."
        )
        self.hold_duration = meter.create_histogram(
            "keel.lock.hold.duration", unit="s", description="How long a lock was held."
        )
        self.lost = meter.create_counter(
            "keel.lock.lost", unit="{lock}", description="Locks lost while held."
        )

    @staticmethod
    def _names(handle: Lock) -> dict[str, Any]:
        return {"keel.lock.store": handle.store_alias, "keel.lock.name": handle.name}

    def start(self, handle: Lock, timeout: float) -> Any:
        caller = trace.get_current_span()
        span = self.tracer.start_span(
            f"lock.acquire {handle.name}",
            kind=SpanKind.INTERNAL,
            attributes={
                **self._names(handle),
                "keel.lock.ttl": handle.ttl,
                "keel.lock.timeout": timeout,
            },
        )
        token = context.attach(trace.set_span_in_context(span))
        return span, token, caller, time.monotonic()

    def _finish(self, handle: Lock, started: Any, outcome: str | None, attempts: int) -> Span:
        span, token, _, began = started
        context.detach(token)
        attributes = self._names(handle)
        if outcome is not None:
            attributes["keel.lock.outcome"] = outcome
            span.set_attribute("keel.lock.outcome", outcome)
        span.set_attribute("keel.lock.attempts", attempts)
        self.acquire_duration.record(time.monotonic() - began, attributes)
        return span  # type: ignore[no-any-return]

    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        span = self._finish(handle, started, "acquired", attempts)
        span.set_attribute("keel.lock.fence", handle.fence or 0)
        span.end()
        caller: Span = started[2]
        caller.add_event(
            "lock.acquired", {**self._names(handle), "keel.lock.fence": handle.fence or 0}
        )
        return [self, caller]  # `ended` adds its event to the caller's span, then forgets it

    def refused(
        self, handle: Lock, started: Any, outcome: str, attempts: int, raises: bool, kept: Any
    ) -> Any:
        span = self._finish(handle, started, outcome, attempts)
        if raises:
            span.set_attribute("error.type", "LockUnavailable")
            span.set_status(Status(StatusCode.ERROR, f"{handle.describe()} not acquired"))
        span.end()
        return None

    def failed(
        self, handle: Lock, started: Any, error: BaseException, attempts: int, kept: Any
    ) -> Any:
        stored = isinstance(error, LockStoreUnavailable)
        span = self._finish(handle, started, "error" if stored else None, attempts)
        span.record_exception(error)
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(Status(StatusCode.ERROR, type(error).__qualname__))
        span.end()
        return None

    def ended(self, handle: Lock, kept: Any, end: str, seconds: float, reason: str | None) -> None:
        names = self._names(handle)
        self.hold_duration.record(seconds, {**names, "keel.lock.end": end})
        caller: Span | None = None
        if kept is not None and kept[0] is self:
            caller, kept[1] = kept[1], None
        event = {**names, "keel.lock.fence": handle.fence or 0, "keel.lock.end": end}
        if reason is None:
            if caller is not None:
                caller.add_event("lock.released", event)
            return
        self.lost.add(1, {**names, "keel.lock.reason": reason})
        if caller is not None:
            caller.add_event("lock.lost", {**event, "keel.lock.reason": reason})
            # on_lost's public value (options.RAISE): options imports the core, which
            # loads this backend.
            if handle.on_lost == "raise":
                caller.set_attribute("error.type", "LockNotHeldError")

    def forced(self, store: str, name: str, seconds: float | None) -> None:
        if seconds is not None:
            attributes = {"keel.lock.store": store, "keel.lock.name": name}
            self.hold_duration.record(seconds, {**attributes, "keel.lock.end": "forced"})
