"""The Redis store: `store` (RedisLockStore), `scripts` (the Lua and the key layout), `clients`
(redis-py: sync, async, a thread's own connection, version shims), `listener` (pub/sub) and
`checks` (its system checks).

RedisLockStore is imported on first use, so that `checks` can be imported without redis-py and
report it missing; without it, using RedisLockStore raises ImproperlyConfigured saying what to
install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import RedisLockStore

__all__ = ["RedisLockStore"]


def __getattr__(name: str) -> Any:
    if name == "RedisLockStore":
        from .store import RedisLockStore

        return RedisLockStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
