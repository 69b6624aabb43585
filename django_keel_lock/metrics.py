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

__all__ = ["ACQUIRE_OUTCOMES", "ENDS", "LOST_REASONS", "RENEWAL_OUTCOMES", "Recorder", "load"]

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
