"""Signals sent by the core. Receivers get `sender=Lock` and `lock=<the handle>`."""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()  # lock
lock_released = Signal()  # lock
lock_lost = Signal()  # lock, reason: str
lock_force_released = Signal()  # key, store (alias), info (LockInfo | None), user (or None)
