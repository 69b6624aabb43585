"""Locks in etcd v3: a Raft cluster keeps every granted lock through the loss of a minority
of its members, the leader's included.

The layout, under KEY_PREFIX (default "keel-lock/"):

    <prefix>lock/<key>   the owner token; bound to the lock's own lease
    <prefix>info/<key>   {"h": holder, "t": acquired at, ms since the epoch}; the same lease

- A lock is a pair of keys bound to a lease whose TTL is the lock's ttl in whole seconds
  (rounded up; etcd's leases have no finer grain, and none shorter than its minimum, 2 s with
  the default election timeout): etcd deletes both when the lease runs out, by the leader's
  clock. A new leader gives every lease its full TTL again, so a failover can lengthen a
  lock, never shorten it.
- acquire is one transaction: if the lock key was never created, put both keys with a lease
  granted just before. The fence is that write's revision (the lock key's create_revision):
  etcd's revisions are cluster-wide and strictly increasing, so no counter is kept.
- release and extend compare the owner in a transaction; reads are linearizable (etcd's
  default), so a lock a minority member no longer sees is never shown as free.
- Releases reach other processes through a watch of the lock keys (`listener`); a lease that
  runs out deletes its keys too, so waiters hear of expiries as well.
- Semaphores, shared locks and the line of waiters are not offered (`supports_modes` and
  `queues` are False): `semaphore()` and `lock(shared=True)` on this store raise ValueError.
"""

from __future__ import annotations

import json
import math
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured

from ...exceptions import LockStoreUnavailable
from ..base import AcquireResult, LockInfo, LockStore
from ..connections import socket_timeout_option
from ..results import ResultStore
from ..wakeups import ListeningStore
from . import checks
from .client import EtcdClient, EtcdUnavailable, b64, parse_endpoints, range_end, unb64
from .listener import EtcdListener
from .revoker import Revoker

DEFAULT_PREFIX = "keel-lock/"
PAGE_SIZE = 100


def lease_seconds(ttl: float) -> int:
    """A lock's ttl as a lease TTL: whole seconds, rounded up (never shorter than asked)."""
    return max(1, math.ceil(ttl - 1e-9))


def _put(name: str, value: str, lease: str) -> dict[str, Any]:
    return {"request_put": {"key": b64(name), "value": b64(value), "lease": lease}}


def _range(name: str) -> dict[str, Any]:
    return {"request_range": {"key": b64(name)}}


def _delete(name: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(name)}}


def _owned_by(name: str, owner: str) -> dict[str, Any]:
    return {"target": "VALUE", "key": b64(name), "result": "EQUAL", "value": b64(owner)}


def _created_at(name: str, revision: int | str) -> dict[str, Any]:
    """A compare: `name`'s create_revision is `revision` (0: it does not exist)."""
    return {
        "target": "CREATE",
        "key": b64(name),
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def _kvs(reply: Mapping[str, Any], at: int) -> list[dict[str, Any]]:
    """The kvs of the range at position `at` in a transaction's answer."""
    responses = reply.get("responses") or []
    return list(responses[at].get("response_range", {}).get("kvs") or [])


class EtcdLockStore(ListeningStore, LockStore):
    """Locks in an etcd v3 cluster (OPTIONS: ENDPOINTS, KEY_PREFIX, SOCKET_TIMEOUT, CA_FILE,
    CERT_FILE, KEY_FILE, USER, PASSWORD).

    ENDPOINTS lists the members' client URLs (["http://10.0.0.1:2379", ...]); a call goes to
    the one that answered last and moves to the next when it fails. SOCKET_TIMEOUT (seconds,
    default 5) bounds a whole call, every endpoint tried included. https endpoints use
    CA_FILE (else the system's CAs) and CERT_FILE / KEY_FILE for a client certificate; USER
    and PASSWORD log in to an etcd with authentication on.
    """

    option_names = frozenset(
        {
            "ENDPOINTS",
            "KEY_PREFIX",
            "SOCKET_TIMEOUT",
            "CA_FILE",
            "CERT_FILE",
            "KEY_FILE",
            "USER",
            "PASSWORD",
        }
    )
    listener_class = EtcdListener
    expires_by_itself = True  # each lock's lease runs out on the leader, deleting it
    #: Seconds a lock on etcd may outlive its ttl: leases count whole seconds (at least the
    #: cluster's minimum, 2 s by default) and the leader looks for expired ones twice a second.
    expiry_slack = 2.5
    admin_note = (
        "Locks in etcd: each lives until its lease runs out, in whole seconds (at least "
        "etcd's minimum lease, 2 s by default); 'expires in' is rounded down."
    )

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        return checks.check_config(alias, options)

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        if "ENDPOINTS" not in self.options:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS needs ENDPOINTS, the etcd members' "
                "client URLs (['http://127.0.0.1:2379'])"
            )
        endpoints = parse_endpoints(alias, self.options["ENDPOINTS"])
        prefix = self.options.get("KEY_PREFIX", DEFAULT_PREFIX)
        if not isinstance(prefix, str):
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS KEY_PREFIX must be a str, got {prefix!r}"
            )
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.prefix = prefix
        self.socket_timeout = socket_timeout_option(alias, self.options)
        self.client = EtcdClient(
            endpoints, self.socket_timeout, self._tls(endpoints), self._credentials()
        )
        self._revoker = Revoker(self.client, alias)

    def _tls(self, endpoints: Any) -> ssl.SSLContext | None:
        if not any(each.scheme == "https" for each in endpoints):
            return None
        context = ssl.create_default_context(cafile=self.options.get("CA_FILE"))
        if self.options.get("CERT_FILE"):
            context.load_cert_chain(self.options["CERT_FILE"], self.options.get("KEY_FILE"))
        return context

    def _credentials(self) -> tuple[str, str] | None:
        user = self.options.get("USER")
        return None if user is None else (str(user), str(self.options.get("PASSWORD", "")))

    # -- names and calls ------------------------------------------------------------------
    def lock_name(self, key: str) -> str:
        return f"{self.prefix}lock/{key}"

    def _info_name(self, key: str) -> str:
        return f"{self.prefix}info/{key}"

    def call(self, path: str, body: Mapping[str, Any], *, once: bool = False) -> Any:
        """etcd's answer to POST `body` to `path`; LockStoreUnavailable when none came in
        time (`EtcdClient.call`)."""
        try:
            return self.client.call(path, body, once=once)
        except EtcdUnavailable as exc:
            raise LockStoreUnavailable(f"lock store {self.alias!r} cannot use etcd: {exc}") from exc

    def txn(self, compare: list[Any], success: list[Any], failure: Sequence[Any] = ()) -> Any:
        """One transaction (sent again to another member if unanswered: every one of ours
        gives the same result run twice, but a release's, which says `once`)."""
        return self.call(
            "/v3/kv/txn", {"compare": compare, "success": success, "failure": list(failure)}
        )

    def grant(self, ttl: float) -> str:
        """A new lease of `ttl` (rounded up to whole seconds); its id."""
        return str(self.call("/v3/lease/grant", {"TTL": lease_seconds(ttl)})["ID"])

    def revoke_later(self, lease: str) -> None:
        """Revoke a lease no key uses any more, in the background (`Revoker`): nothing waits
        for it, and if it fails, or too many wait already (a slow etcd), the lease runs out by
        itself."""
        self._revoker.put(lease)

    def _time_to_live(self, lease: str) -> int:
        """Whole seconds left on `lease` (rounded down), never more than it was granted; -1
        when it is gone."""
        reply = self.call("/v3/lease/timetolive", {"ID": lease})
        # The gateway leaves out zeros: no TTL is 0 s left (under a second), not gone.
        left = int(reply.get("TTL", 0))
        # A member that has just become leader says 'for ever' (2**63 ns) until it has applied
        # its term's first entry, and then gives every lease its whole TTL again (and an
        # election timeout more): what was granted is all a holder may count on.
        return min(left, int(reply.get("grantedTTL", 0))) if left > 0 else left

    # -- the protocol ---------------------------------------------------------------------
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        lease = self.grant(ttl)
        try:
            return self._acquire(key, owner, holder, lease)
        except LockStoreUnavailable:
            # Its transaction may have been applied, the reply lost: a lock the caller, told
            # the store failed, will never release. The lease goes, and any key put with it.
            self.revoke_later(lease)
            raise

    def _acquire(self, key: str, owner: str, holder: str, lease: str) -> AcquireResult:
        """`acquire` with the `lease` granted for it."""
        name = self.lock_name(key)
        info = json.dumps({"h": holder, "t": round(time.time() * 1000)})
        writes = [_put(name, owner, lease), _put(self._info_name(key), info, lease)]
        for _ in range(2):
            reply = self.txn([_created_at(name, 0)], writes, [_range(name)])
            if reply.get("succeeded"):
                return AcquireResult(int(reply["header"]["revision"]))
            found = _kvs(reply, 0)
            if not (found and unb64(found[0].get("value", "")) == owner):
                break
            # The asker's own lock (a retry after a lost reply): renewed with the new lease. Its
            # old lease goes, unless it is this one (the client sent the transaction again,
            # to another member, after the first one's reply was lost).
            created, old = found[0]["create_revision"], found[0].get("lease", "0")
            again = self.txn([_owned_by(name, owner), _created_at(name, created)], writes)
            if again.get("succeeded"):
                if old != lease:
                    self.revoke_later(old)
                return AcquireResult(int(created))
            # Gone since (its lease revoked, by this process after the failed attempt that
            # put it, or run out) or taken: the first transaction says which, once more.
        self.revoke_later(lease)
        return AcquireResult(None, None, "exclusive")

    def release(self, key: str, owner: str) -> bool:
        name = self.lock_name(key)
        reply = self.call(
            "/v3/kv/txn",
            {
                "compare": [_owned_by(name, owner)],
                "success": [_range(name), _delete(name), _delete(self._info_name(key))],
            },
            once=True,  # sent twice, the second would find it gone and say "not released"
        )
        if not reply.get("succeeded"):
            return False
        found = _kvs(reply, 0)
        if found:
            self.revoke_later(found[0].get("lease", "0"))
        self.wake_board.wake(key)
        return True

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        name, info_name = self.lock_name(key), self._info_name(key)
        reply = self.txn([_owned_by(name, owner)], [_range(name), _range(info_name)])
        found = _kvs(reply, 0) if reply.get("succeeded") else []
        if not found:
            return False
        old = found[0].get("lease", "0")
        left = self._time_to_live(old)
        if left < 0:
            return False
        if left >= ttl:
            return True  # it lives that long already: never shortened
        lease = self.grant(ttl)
        info = _kvs(reply, 1)
        value = unb64(info[0]["value"]) if info else json.dumps({"h": "", "t": None})
        again = self.txn(
            [_owned_by(name, owner), _created_at(name, found[0]["create_revision"])],
            [_put(name, owner, lease), _put(info_name, value, lease)],
        )
        if not again.get("succeeded"):
            self.revoke_later(lease)
            return False
        self.revoke_later(old)
        return True

    def get(self, key: str) -> LockInfo | None:
        reply = self.txn([], [_range(self.lock_name(key)), _range(self._info_name(key))])
        found, info = _kvs(reply, 0), _kvs(reply, 1)
        if not found:
            return None
        return self._info(key, found[0], info[0] if info else None)

    def _info(
        self, key: str, found: Mapping[str, Any], info: Mapping[str, Any] | None
    ) -> LockInfo | None:
        """The LockInfo of a lock key's kv `found` and its info kv; None once its lease is
        gone (it expired since it was read)."""
        left = self._time_to_live(found.get("lease", "0"))
        if left < 0:
            return None
        details = json.loads(unb64(info["value"])) if info else {}
        at = details.get("t")
        return LockInfo(
            key=key,
            owner=unb64(found.get("value", "")),
            holder=str(details.get("h", "")),
            fence=int(found["create_revision"]),
            acquired_at=None if at is None else datetime.fromtimestamp(at / 1000.0, tz=UTC),
            expires_in=float(left),
        )

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Live locks under `prefix`, in key order, a page of PAGE_SIZE at a time."""
        start = self.lock_name(prefix)
        end = range_end(start)
        cut = len(self.lock_name(""))
        key = b64(start)
        while True:
            page = self.call("/v3/kv/range", {"key": key, "range_end": end, "limit": PAGE_SIZE})
            kvs = page.get("kvs") or []
            for found in kvs:
                name = unb64(found["key"])[cut:]
                info = self.call("/v3/kv/range", {"key": b64(self._info_name(name))})
                each = self._info(name, found, (info.get("kvs") or [None])[0])
                if each is not None:
                    yield each
            if not page.get("more") or not kvs:
                return
            key = b64(unb64(kvs[-1]["key"]) + "\0")

    def result_store(self) -> ResultStore:
        """Where idempotent results of this store's locks are kept: beside them in etcd."""
        from .results import EtcdResults

        return EtcdResults(self)

    def close(self) -> None:
        self.stop_listener()
        self._revoker.close()
        self.client.close()
