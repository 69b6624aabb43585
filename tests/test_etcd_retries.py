"""The etcd store's calls when a reply is lost or crawls: a request sent again to the next member
must do no harm, and no call outlives SOCKET_TIMEOUT. On the run's 3-member cluster
(tests/conftest.etcd_alias), reached through proxies in front of one member."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

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
