"""The Redis store: `store` (RedisLockStore), `scripts` (the Lua and the key layout), `clients`
(redis-py: sync, async, a thread's own connection, version shims) and `listener` (pub/sub)."""

from __future__ import annotations

from .store import RedisLockStore

__all__ = ["RedisLockStore"]
