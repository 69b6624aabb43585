"""Idempotent results of a `RedisLockStore`: one hash per key, beside the key's lock.

    keel-lock:{key}:result   hash: f fence, p fingerprint, s status, d data, t stored at
                             (ms since the epoch, by the server's TIME); PX = the result's ttl

It shares the lock's hash tag, so on a Cluster it lives in the lock's slot and one script reads
the lock and writes the result (`scripts.KEEP_RESULT`), or releases the lock too
(`RELEASE_KEEPING`, `RELEASE_IF_KEPT`: a request's round trip fewer). A write waits for
MIN_REPLICAS replicas as an acquire does; one they did not acknowledge is kept (the lock may
be released already) and said in a WARNING: a failover before they have it loses it, and a
retry then runs again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from ...exceptions import LockStoreUnavailable
from ..results import Release, ResultStore, StoredResult
from .clients import STORE_ERRORS, as_text
from .scripts import (
    KEEP_RESULT,
    RELEASE_IF_KEPT,
    RELEASE_KEEPING,
    Script,
    escape_key,
    glob_quote,
    unescape_key,
)

SUFFIX = ":result"

logger = logging.getLogger("django_keel_lock")


class RedisResults(ResultStore):
    """Results beside the locks of `store` (a RedisLockStore), through its client."""

    def __init__(self, store: Any) -> None:
        self.store = store

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
        keys = (self.store.lock_name(key), self._name(key))
        args = (owner, *_fields(fence, result, ttl))
        return self._write(KEEP_RESULT, key, keys, args) == 1

    def save_releasing(
        self, key: str, owner: str, fence: int, result: StoredResult, ttl: float, release: Release
    ) -> tuple[bool, bool]:
        keys, args = self.store.releasing_call(key, owner)
        keys, args = (*keys, self._name(key)), (*args, *_fields(fence, result, ttl))
        reply = self._write(RELEASE_KEEPING, key, keys, args, kept=2)
        return reply == 2, self.store.released_by(key, reply > 0)

    def get_releasing(
        self, key: str, owner: str, release: Release
    ) -> tuple[StoredResult | None, bool | None]:
        keys, args = self.store.releasing_call(key, owner)
        keys = (*keys, self._name(key))
        reply = self.store.run_extra(RELEASE_IF_KEPT, keys, args, writes=False)[0]
        if not reply:
            return None, None
        released, fields = reply
        found = _result(key, dict(zip(fields[::2], fields[1::2], strict=True)))
        return found, self.store.released_by(key, int(released) > 0)

    def _write(
        self, script: Script, key: str, keys: tuple[str, ...], args: tuple[Any, ...], kept: int = 1
    ) -> int:
        """Run `script`, which replies `kept` when it kept the result, waiting for
        MIN_REPLICAS; its reply."""
        reply, acknowledged = self.store.run_extra(script, keys, args, writes=True)
        if not acknowledged and int(reply) == kept:
            logger.warning(
                "idempotent result %r: fewer than the %d replicas of MIN_REPLICAS acknowledged "
                "it (lock store %r); a failover before they have it loses it, and a retry "
                "then runs again",
                key,
                self.store.min_replicas,
                self.store.alias,
            )
        return int(reply)

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


def _fields(fence: int, result: StoredResult, ttl: float) -> tuple[Any, ...]:
    """The scripts' ARGV for a result: fence, fingerprint, status, data, ttl (ms)."""
    return fence, result.fingerprint, result.status, result.data, max(1, round(ttl * 1000))


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
