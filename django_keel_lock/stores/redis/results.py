"""Idempotent results of a `RedisLockStore`: one hash per key, beside the key's lock.

    keel-lock:{key}:result   hash: f fence, p fingerprint, s status, d data, t stored at
                             (ms since the epoch, by the server's TIME); PX = the result's ttl

It shares the lock's hash tag, so on a Cluster it lives in the lock's slot and SAVE reads the
lock and writes the result in one script.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from ...exceptions import LockStoreUnavailable
from ..results import ResultStore, StoredResult
from .clients import STORE_ERRORS, as_text
from .scripts import escape_key, glob_quote, unescape_key

SUFFIX = ":result"

#: KEYS: the lock, the result. ARGV: owner, fence, fingerprint, status, data, ttl (ms).
#: Kept only while the lock has `owner`, and never over a result of a fence as high.
SAVE = """
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
    return 0
end
local kept = redis.call('HGET', KEYS[2], 'f')
if kept and tonumber(kept) >= tonumber(ARGV[2]) then
    return 0
end
local now = redis.call('TIME')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'f', ARGV[2], 'p', ARGV[3], 's', ARGV[4], 'd', ARGV[5],
           't', string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000)))
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return 1
"""


class RedisResults(ResultStore):
    """Results beside the locks of `store` (a RedisLockStore), through its client."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._save: Any = None

    def _name(self, key: str) -> str:
        return str(self.store.lock_name(key)) + SUFFIX

    def _unavailable(self, exc: Exception) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"lock store {self.store.alias!r} cannot read or keep idempotent results in "
            f"Redis: {type(exc).__name__}: {exc}"
        )

    def get(self, key: str) -> StoredResult | None:
        try:
            fields = self.store.client().hgetall(self._name(key))
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        return _result(key, fields)

    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        client = self.store.client()
        try:
            if self._save is None:
                self._save = client.register_script(SAVE)
            kept = self._save(
                keys=[self.store.lock_name(key), self._name(key)],
                args=[owner, fence, result.fingerprint, result.status, result.data,
                      max(1, round(ttl * 1000))],
                client=client,
            )  # fmt: skip
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc
        return bool(int(kept))

    def forget(self, key: str) -> bool:
        try:
            return bool(self.store.client().delete(self._name(key)))
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        start = f"{self.store.prefix}{{"
        pattern = f"{glob_quote(start)}{glob_quote(escape_key(prefix))}*}}{SUFFIX}"
        client = self.store.client()
        try:
            for name in client.scan_iter(match=pattern, count=1000):
                text = as_text(name)
                key = unescape_key(text[len(start) : -len(SUFFIX) - 1])
                found = _result(key, client.hgetall(name))
                if found is not None:
                    yield found
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc


def _result(key: str, fields: Any) -> StoredResult | None:
    if not fields:
        return None
    got = {as_text(name): value for name, value in fields.items()}
    if "f" not in got:
        return None
    data = got.get("d", b"")
    return StoredResult(
        key=key,
        fingerprint=as_text(got.get("p", b"")),
        fence=int(got["f"]),
        status=int(got.get("s", 0)),
        data=data if isinstance(data, bytes) else str(data).encode("utf-8"),
        created_at=datetime.fromtimestamp(int(got.get("t", 0)) / 1000, UTC),
    )
