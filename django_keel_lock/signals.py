"""Signals sent by the core. Receivers get `sender=Lock` and `lock=<the handle>`."""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

lock_acquired = Signal()  # lock
lock_released = Signal()  # lock
lock_lost = Signal()  # lock, reason: str
lock_force_released = Signal()  # key, store (alias), info (LockInfo | None), user (or None)


def announce(signal: Signal, sender: type, **kwargs: Any) -> None:
    """Send one of our signals. A receiver that raises is logged (by Django, logger
    "django.dispatch"), not propagated: it must not strand an acquired lock nor cut a release
    short."""
    if signal.receivers:
        signal.send_robust(sender=sender, **kwargs)
