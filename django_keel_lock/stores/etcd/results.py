"""Idempotent results of an `EtcdLockStore`: one key per result, beside the key's lock.

    <prefix>result/<key>   {"f": fence, "p": fingerprint, "s": status, "d": data (base64),
                            "t": stored at, ms since the epoch by the app server's clock, shown
                            only}; bound to a lease of the result's ttl

A result is kept in one transaction that compares the lock: its owner is the writer, its
create_revision (the fence) is the writer's, and the result key was last written before that
revision, so by an earlier holder (or never): a holder that lost its lock keeps nothing, and no
result is written over one of the same or a later fence.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..results import ResultStore, StoredResult
from .client import b64, range_end, unb64

if TYPE_CHECKING:
    from .store import EtcdLockStore

PAGE_SIZE = 100


class EtcdResults(ResultStore):
    """Results beside the locks of `store`, through its client."""

    def __init__(self, store: EtcdLockStore) -> None:
        self.store = store

    def _name(self, key: str) -> str:
        return f"{self.store.prefix}result/{key}"

    def get(self, key: str) -> StoredResult | None:
        kvs = self.store.call("/v3/kv/range", {"key": b64(self._name(key))}).get("kvs") or []
        return _result(key, kvs[0]) if kvs else None

    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        lock, name = self.store.lock_name(key), self._name(key)
        value = json.dumps(
            {
                "f": fence,
                "p": result.fingerprint,
                "s": result.status,
                "d": base64.b64encode(result.data).decode("ascii"),
                "t": round(datetime.now(UTC).timestamp() * 1000),
            }
        )
        lease = self.store.grant(ttl)
        compare = [
            {"target": "VALUE", "key": b64(lock), "result": "EQUAL", "value": b64(owner)},
            {
                "target": "CREATE",
                "key": b64(lock),
                "result": "EQUAL",
                "create_revision": str(fence),
            },
            {"target": "MOD", "key": b64(name), "result": "LESS", "mod_revision": str(fence)},
        ]
        put = {"request_put": {"key": b64(name), "value": b64(value), "lease": lease}}
        reply = self.store.txn(compare, [put], [{"request_range": {"key": b64(name)}}])
        if reply.get("succeeded") or _written_with(reply, lease):
            return True
        self.store.revoke_later(lease)
        return False

    def forget(self, key: str) -> bool:
        reply = self.store.call("/v3/kv/deleterange", {"key": b64(self._name(key))})
        return int(reply.get("deleted", 0)) > 0

    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        start = self._name(prefix)
        end, cut = range_end(start), len(self._name(""))
        key = b64(start)
        while True:
            body = {"key": key, "range_end": end, "limit": PAGE_SIZE}
            page = self.store.call("/v3/kv/range", body)
            kvs = page.get("kvs") or []
            for found in kvs:
                yield _result(unb64(found["key"])[cut:], found)
            if not page.get("more") or not kvs:
                return
            key = b64(unb64(kvs[-1]["key"]) + "\0")


def _written_with(reply: dict[str, Any], lease: str) -> bool:
    """Whether a refused save's transaction found the result written with `lease`: by this
    same save, whose first reply was lost and which the client sent again to the next member
    (a lease is granted anew for every save)."""
    responses = reply.get("responses") or [{}]
    found = responses[0].get("response_range", {}).get("kvs") or []
    return bool(found) and str(found[0].get("lease", "0")) == lease


def _result(key: str, found: dict[str, Any]) -> StoredResult:
    kept = json.loads(unb64(found["value"]))
    return StoredResult(
        key=key,
        fingerprint=str(kept["p"]),
        fence=int(kept["f"]),
        status=int(kept["s"]),
        data=base64.b64decode(kept["d"]),
        created_at=datetime.fromtimestamp(kept["t"] / 1000.0, tz=UTC),
    )
