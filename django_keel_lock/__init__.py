"""django-keel-lock: distributed locks for Django that stay correct under failure."""

from __future__ import annotations

from .core import Lock, LockOutcome, force_release, lock, restore_lock, semaphore
from .decorators import locked
from .exceptions import (
    AlreadyQueued,
    InvalidLockToken,
    LockError,
    LockNotHeldError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
    LockUnavailable,
)
from .idempotency import idempotent, once, run_once
from .leaders import election
from .multi import MultiLock
from .registry import get_lock_store, set_lock_store
from .version import __version__
from .views import LockViewMixin, lock_view

__all__ = [
    "AlreadyQueued",
    "InvalidLockToken",
    "Lock",
    "LockError",
    "LockNotHeldError",
    "LockOutcome",
    "LockStoreMisconfigured",
    "LockStoreUnavailable",
    "LockUnavailable",
    "LockViewMixin",
    "MultiLock",
    "__version__",
    "election",
    "force_release",
    "get_lock_store",
    "idempotent",
    "lock",
    "lock_view",
    "locked",
    "once",
    "restore_lock",
    "run_once",
    "semaphore",
    "set_lock_store",
]
