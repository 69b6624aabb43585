"""The etcd store's calls when a reply is lost or crawls: a request sent again to the next member
must do no harm, and no call outlives SOCKET_TIMEOUT. On the run's 3-member cluster
(tests/conftest.etcd_alias), reached through proxies in front of one member."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from django_keel_lock import LockStoreUnavailable, get_lock_store
from django_keel_lock.stores import EtcdLockStore
from django_keel_lock.stores.results import StoredResult
from tests.support.etcd import LosesOneReply


class Crawls(LosesOneReply):
    """A TCP proxy in front of a member that passes requests on at once and replies a byte at a
    time, `pause` seconds apart: a member (or link) that answers, but too slowly to matter."""

    def __init__(self, target_port: int, pause: float = 0.05) -> None:
        self.pause = pause
        self._closed = threading.Event()
        super().__init__(target_port)

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while (data := upstream.recv(65536)) and not self._closed.is_set():
                for at in range(len(data)):
                    client.sendall(data[at : at + 1])
                    if self._closed.wait(self.pause):
                        break
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._closed.set()
        super().close()


def _members(alias: str) -> list[str]:
    return list(get_lock_store(alias).options["ENDPOINTS"])


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
def through_lossy_proxy(etcd_alias: str) -> Iterator[tuple[EtcdLockStore, LosesOneReply]]:
    """A store whose first endpoint is a proxy that can lose one reply; the others direct."""
    members = _members(etcd_alias)
    proxy = LosesOneReply(_port(members[0]))
    store = EtcdLockStore("etcd-retries", {"ENDPOINTS": [proxy.url, *members[1:]]})
    try:
        yield store, proxy
    finally:
        store.close()
        proxy.close()


def test_a_result_whose_save_reply_was_lost_is_kept_and_said_kept(
    through_lossy_proxy: tuple[EtcdLockStore, LosesOneReply], key: str
) -> None:
    """The save is applied, its reply lost, the transaction sent again to the next member: that
    one finds the result written (by this very save) and must not call it refused, nor revoke
    the lease it was just written with (which deletes it)."""
    store, proxy = through_lossy_proxy
    results = store.result_store()
    fence = store.acquire(key, "owner-a", "a", 30).fence
    assert fence is not None
    proxy.armed = "/v3/kv/txn"
    assert results.save(key, "owner-a", fence, StoredResult(key, "fp", 0, 200, b"ok"), 60)
    assert proxy.cut == 1
    time.sleep(0.5)  # a lease wrongly revoked behind the reply would have taken it by now
    kept = results.get(key)
    assert kept is not None and (kept.fence, kept.data) == (fence, b"ok")
    # A second save by the same holder is still refused: never over the same fence.
    assert not results.save(key, "owner-a", fence, StoredResult(key, "fp", 0, 201, b"no"), 60)
    assert store.release(key, "owner-a")


def test_a_member_that_crawls_cannot_hold_a_call_past_socket_timeout(
    etcd_alias: str, key: str
) -> None:
    """SOCKET_TIMEOUT bounds the whole call, not each read of it: a member that sends its
    answer a byte every 50 ms (a reply of some 300 bytes: 15 s) is given up on in time."""
    proxy = Crawls(_port(_members(etcd_alias)[0]))
    store = EtcdLockStore("etcd-crawls", {"ENDPOINTS": [proxy.url], "SOCKET_TIMEOUT": 1})
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            store.acquire(key, "owner-a", "a", 30)
            outcome.append(None)
        except BaseException as exc:  # reported below
            outcome.append(exc)

    try:
        started = time.monotonic()
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(3)
        took = time.monotonic() - started
        assert not worker.is_alive(), f"the call still runs after {took:.1f} s"
        assert isinstance(outcome[0], LockStoreUnavailable) and took < 1.5
    finally:
        proxy.close()
        store.close()


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as reply:
        return dict(json.load(reply))


def _hand_leadership_on(members: list[str], then: list[threading.Thread]) -> None:
    """Ask the leader to hand its leadership to another member (etcd's MoveLeader), starting
    the threads `then` just before."""
    for url in members:
        status = _post(url, "/v3/maintenance/status", {})
        if status["leader"] == status["header"]["member_id"]:
            others = [_post(each, "/v3/maintenance/status", {}) for each in members if each != url]
            target = others[0]["header"]["member_id"]
            for thread in then:
                thread.start()
            with contextlib.suppress(OSError):  # it answers once the new leader leads
                _post(url, "/v3/maintenance/transfer-leadership", {"targetID": target})
            return


def test_a_new_leader_never_makes_a_lock_look_longer_lived_than_its_lease(
    etcd_alias: str, key: str
) -> None:
    """A member that has just become leader answers a lease's time to live with 'for ever'
    (9223372036 s) until it has applied its term's first entry: get() must not show that, and
    an extend asking for more than the lease has must not take it for an answer (its holder
    would count on a lease that runs out at its own TTL). Leadership is handed on 6 times,
    threads asking all along and extending locks of 2 s to 30 s as it goes."""
    store = get_lock_store(etcd_alias)
    members = list(store.options["ENDPOINTS"])
    watched, short = f"{key}:30s", [f"{key}:{n}" for n in range(72)]
    for each, ttl in [(watched, 30), *((each, 2) for each in short)]:
        assert store.acquire(each, "owner-a", "a", ttl).fence is not None
    shown: list[float] = []
    extended: list[str] = []
    stop = threading.Event()

    def show() -> None:
        while not stop.is_set():
            with contextlib.suppress(LockStoreUnavailable):
                info = store.get(watched)
                shown.append(info.expires_in if info else 0.0)

    def extend(keys: list[str]) -> None:
        for each in keys:
            with contextlib.suppress(LockStoreUnavailable):
                if store.extend(each, "owner-a", 30):
                    extended.append(each)

    threads = [threading.Thread(target=show) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for round in range(6):
            burst = [
                threading.Thread(target=extend, args=(short[at : at + 3],))
                for at in range(12 * round, 12 * round + 12, 3)
            ]
            threads += burst
            _hand_leadership_on(members, then=burst)
            time.sleep(0.15)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert shown and max(shown) <= 30
    for each in extended:  # each extend said yes: its lock lives 30 s, not 2
        info = store.get(each)
        # Far above 2 s; not 25: on a loaded machine the first extends are 6 s old by now.
        assert info is not None and info.expires_in >= 10, each
    for each in [watched, *short]:
        store.release(each, "owner-a")


def test_revocations_queued_against_a_frozen_member_do_not_delay_async_calls() -> None:
    """Leases to revoke queue up (16 at most) when etcd is slow, each waiting up to 1 s: they
    must not hold the threads async calls run on, or an aacquire waits behind them past
    SOCKET_TIMEOUT. The member is a socket that takes connections and never answers, as a
    stopped (SIGSTOP) member does."""
    frozen = socket.create_server(("127.0.0.1", 0), backlog=64)
    url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    store = EtcdLockStore("etcd-frozen", {"ENDPOINTS": [url], "SOCKET_TIMEOUT": 1})
    try:
        for lease in range(1, 17):
            store.revoke_later(str(lease))
        started = time.monotonic()
        with pytest.raises(LockStoreUnavailable):
            asyncio.run(store.aacquire("k", "owner-a", "a", 30))
        assert time.monotonic() - started < 1.5  # 3 s before: 16 revocations, 6 threads
    finally:
        store.close()
        frozen.close()
