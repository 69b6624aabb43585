"""The Redis store (moved here from stores/redis.py)."""

from .store import ACQUIRE, SCRIPTS, RedisLockStore, _text

__all__ = ["ACQUIRE", "SCRIPTS", "RedisLockStore", "_text"]
