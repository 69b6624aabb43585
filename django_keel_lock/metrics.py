"""What the core tells Prometheus and OpenTelemetry, when `KEEL_LOCK_METRICS` asks for them.

`core.Lock` calls the one `recorder` at each step of an acquisition: acquired or refused,
failed, renewed, ended (released, lost, expired) and forced free, passing what each step
needs: a backend reads no handle's private state (`Recorder` says what it gets). Every
surface goes through `core.Lock`, so each is measured alike. With metrics off (the default)
`recorder` is None, the core's one check, and neither prometheus_client nor opentelemetry
is imported.

The setting is read when the app starts and again whenever it changes (`override_settings`);
a backend whose package is missing is left out, and the system check W011 says so.

Metrics show a lock's *name* (`Lock.name`: a surface's key template, `name=`, or the key
normalised by `options.lock_name`), its store alias and bounded outcome words, never its key,
owner or holder: a label's values must stay few.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from .conf import METRIC_BACKENDS, conf
from .instruments.base import (
    ACQUIRE_OUTCOMES,
    ENDS,
    LOST_REASONS,
    RENEWAL_OUTCOMES,
    Recorder,
)

if TYPE_CHECKING:
    from .core import Lock

__all__ = [
    "ACQUIRE_OUTCOMES",
    "ENDS",
    "LOST_REASONS",
    "RENEWAL_OUTCOMES",
    "Meter",
    "Recorder",
    "begin",
    "load",
    "store_error",
]

logger = logging.getLogger("django_keel_lock")


class _All(Recorder):
    """Several backends at once (KEEL_LOCK_METRICS = ["prometheus", "otel"])."""

    def __init__(self, recorders: list[Recorder]) -> None:
        self.recorders = recorders
        self.traces = True

    def _each(self, kept: Any) -> Any:
        """Each backend's own `kept`, out of ours."""
        if kept is not None and kept[0] is self:
            return kept[1]
        return [None] * len(self.recorders)

    def start(self, handle: Lock, timeout: float) -> Any:
        return [each.start(handle, timeout) for each in self.recorders]

    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        every = zip(self.recorders, started, self._each(kept), strict=True)
        return self, [each.acquired(handle, state, attempts, mine) for each, state, mine in every]

    def refused(
        self, handle: Lock, started: Any, outcome: str, attempts: int, raises: bool, kept: Any
    ) -> Any:
        every = zip(self.recorders, started, self._each(kept), strict=True)
        return self, [
            each.refused(handle, state, outcome, attempts, raises, mine)
            for each, state, mine in every
        ]

    def failed(
        self, handle: Lock, started: Any, error: BaseException, attempts: int, kept: Any
    ) -> Any:
        every = zip(self.recorders, started, self._each(kept), strict=True)
        return self, [
            each.failed(handle, state, error, attempts, mine) for each, state, mine in every
        ]

    def ended(self, handle: Lock, kept: Any, end: str, seconds: float, reason: str | None) -> None:
        for each, mine in zip(self.recorders, self._each(kept), strict=True):
            each.ended(handle, mine, end, seconds, reason)

    def renewal(self, handle: Lock, kept: Any, outcome: str) -> None:
        for each, mine in zip(self.recorders, self._each(kept), strict=True):
            each.renewal(handle, mine, outcome)

    def store_error(self, handle: Lock, operation: str) -> None:
        for each in self.recorders:
            each.store_error(handle, operation)

    def forced(self, store: str, name: str, seconds: float | None) -> None:
        for each in self.recorders:
            each.forced(store, name, seconds)


#: The recorder the core reports to; None while metrics are off.
recorder: Recorder | None = None


class Meter:
    """One handle's events, told to the recorder that was on when its acquire began: the
    acquire was taken, refused or failed; a watchdog renewal; the hold ended (released, lost
    or expired: once, though a release and the watchdog may race); a store error.

    `kept` is what the recorder keeps on the handle (`Recorder`), handed back, never read
    here; `since` is when the acquisition being measured was sent (None: none is)."""

    __slots__ = ("kept", "recorder", "since", "started")

    def __init__(self, recorder: Recorder, kept: Any) -> None:
        self.recorder, self.kept = recorder, kept
        self.started: Any = None
        self.since: float | None = None

    def acquired(self, handle: Lock, attempts: int, sent: float) -> None:
        self.since = sent
        self.kept = self.recorder.acquired(handle, self.started, attempts, self.kept)

    def refused(self, handle: Lock, waited: bool, attempts: int, raises: bool) -> None:
        outcome = "timeout" if waited else "contended"
        kept = self.recorder.refused(handle, self.started, outcome, attempts, raises, self.kept)
        self.kept = kept

    def failed(self, handle: Lock, error: BaseException, attempts: int) -> None:
        self.kept = self.recorder.failed(handle, self.started, error, attempts, self.kept)

    def renewed(self, handle: Lock, outcome: str) -> None:
        if self.since is not None:
            self.recorder.renewal(handle, self.kept, outcome)

    def ended(
        self,
        handle: Lock,
        end: str,
        reason: str | None,
        mutex: AbstractContextManager[object] | None,
    ) -> None:
        """The hold ended as `end`: told once (`mutex`: the handle's, when another thread may
        end it too)."""
        if mutex is None:
            since, self.since = self.since, None
        else:
            with mutex:
                since, self.since = self.since, None
        if since is not None:
            self.recorder.ended(handle, self.kept, end, time.monotonic() - since, reason)


def begin(handle: Lock, meter: Meter | None, timeout: float) -> Meter:
    """The meter of an acquire of `handle` beginning now, waiting up to `timeout`, while
    metrics are on: the handle's last `meter` while the same recorder is on. A recorder
    without traces is handed the time the acquire began."""
    current = recorder
    assert current is not None
    if meter is None or meter.recorder is not current:
        meter = Meter(current, None if meter is None else meter.kept)
    meter.started = current.start(handle, timeout) if current.traces else time.monotonic()
    return meter


def store_error(meter: Meter | None, handle: Lock, operation: str) -> None:
    """`operation` failed with LockStoreUnavailable: told to the recorder measuring the
    handle's acquisition, else to the one on now."""
    told = meter.recorder if meter is not None and meter.since is not None else recorder
    if told is not None:
        told.store_error(handle, operation)


def _build(name: str) -> Recorder:
    # The package first: our module may have been imported while the package still was.
    import_module(METRIC_BACKENDS[name])
    if name == "prometheus":
        from .instruments import prometheus

        return prometheus.recorder()
    from .instruments import otel

    return otel.OtelRecorder()


def load() -> Recorder | None:
    """(Re)read KEEL_LOCK_METRICS and make `recorder` what it asks for. A backend whose
    package is missing, or a malformed setting, is logged and left out: the app still starts,
    and `manage.py check` reports it (W011)."""
    global recorder
    try:
        names = conf.METRICS
    except ImproperlyConfigured as exc:
        logger.error("metrics are off: %s", exc)
        names = ()
    built = []
    for name in names:
        try:
            built.append(_build(name))
        except ImportError as exc:
            logger.error(
                "KEEL_LOCK_METRICS names %r but %s cannot be imported (%s): pip install "
                "'django-keel-lock[%s]'",
                name,
                METRIC_BACKENDS[name],
                exc,
                name,
            )
    recorder = None if not built else built[0] if len(built) == 1 else _All(built)
    return recorder


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "KEEL_LOCK_METRICS":
        load()
