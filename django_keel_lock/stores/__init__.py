"""Stores behind one protocol. Drivers are imported only when their store is used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import EXCLUSIVE, SHARED, AcquireResult, LockInfo, LockStore, Mode, semaphore_mode
from .memory import MemoryLockStore
from .permits import Held, Plan, Step, plan_acquire

if TYPE_CHECKING:
    from .database import DatabaseLockStore
    from .etcd import EtcdLockStore
    from .redis import RedisLockStore

__all__ = [
    "EXCLUSIVE",
    "SHARED",
    "AcquireResult",
    "DatabaseLockStore",
    "EtcdLockStore",
    "Held",
    "LockInfo",
    "LockStore",
    "MemoryLockStore",
    "Mode",
    "Plan",
    "RedisLockStore",
    "Step",
    "plan_acquire",
    "semaphore_mode",
]


def __getattr__(name: str) -> Any:
    if name == "DatabaseLockStore":
        from .database import DatabaseLockStore

        return DatabaseLockStore
    if name == "EtcdLockStore":
        from .etcd import EtcdLockStore

        return EtcdLockStore
    if name == "RedisLockStore":
        from .redis import RedisLockStore

        return RedisLockStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
