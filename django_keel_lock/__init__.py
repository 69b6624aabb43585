"""django-keel-lock: distributed locks for Django that stay correct under failure."""

from __future__ import annotations

from .conf import get_lock_store, set_lock_store
from .core import Lock, LockOutcome, lock, restore_lock
from .exceptions import (
    InvalidLockToken,
    LockError,
    LockNotHeldError,
    LockStoreUnavailable,
    LockUnavailable,
)

__all__ = [
    "InvalidLockToken",
    "Lock",
    "LockError",
    "LockNotHeldError",
    "LockOutcome",
    "LockStoreUnavailable",
    "LockUnavailable",
    "get_lock_store",
    "lock",
    "restore_lock",
    "set_lock_store",
]
