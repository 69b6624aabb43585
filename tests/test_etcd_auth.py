"""The etcd store on a guarded etcd: authentication on (USER, PASSWORD), on a one-member
cluster of the module's own whose root user is added and authentication enabled through the
gateway; and https with a client certificate (CA_FILE, CERT_FILE, KEY_FILE), certificates made
by openssl for the test."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.stores import EtcdLockStore
from tests.conftest import skip_or_fail
from tests.support.etcd import Cluster, etcd_cluster, etcd_installed


@pytest.fixture(scope="module")
def guarded() -> Iterator[Cluster]:
    if not etcd_installed():
        skip_or_fail("SERVER UNAVAILABLE: etcd (Debian's etcd-server) is not installed")
    with etcd_cluster(size=1) as cluster:
        admin = EtcdLockStore("etcd-admin", {"ENDPOINTS": cluster.endpoints})
        for path, body in (
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/add", {"name": "root", "password": "s3cret"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            admin.client.call(path, body)
        admin.close()
        yield cluster


def test_with_user_and_password_locks_work_and_releases_wake_waiters(
    guarded: Cluster, key: str
) -> None:
    options = {"ENDPOINTS": guarded.endpoints, "USER": "root", "PASSWORD": "s3cret"}
    store, other = EtcdLockStore("etcd-auth", options), EtcdLockStore("etcd-auth2", options)
    try:
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        with other.watch(key) as waiter:
            deadline = time.monotonic() + 10
            while not other.push_wakeups:  # the watch is made with the token too
                assert time.monotonic() < deadline, "the watch never started"
                time.sleep(0.02)
            waiter.poll()
            assert store.release(key, "owner-a")
            assert waiter.wait(5), "the release did not reach the other store's watch"
    finally:
        store.close()
        other.close()


@pytest.mark.parametrize(
    ("credentials", "says"),
    [({}, "user name is empty"), ({"USER": "root", "PASSWORD": "wrong"}, "authentication failed")],
)
def test_without_the_right_credentials_every_call_is_unavailable(
    guarded: Cluster, key: str, credentials: dict[str, str], says: str
) -> None:
    store = EtcdLockStore("etcd-auth", {"ENDPOINTS": guarded.endpoints, **credentials})
    try:
        with pytest.raises(LockStoreUnavailable, match=says):
            store.acquire(key, "owner-a", "a", 30)
    finally:
        store.close()


# -- TLS --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secured() -> Iterator[Cluster]:
    """A one-member cluster on https that asks for a client certificate."""
    if not etcd_installed():
        skip_or_fail("SERVER UNAVAILABLE: etcd (Debian's etcd-server) is not installed")
    with etcd_cluster(size=1, tls=True) as cluster:
        yield cluster


def test_https_endpoints_with_the_ca_and_a_client_certificate_take_locks_and_hear_releases(
    secured: Cluster, key: str
) -> None:
    assert secured.tls is not None
    options = {
        "ENDPOINTS": secured.endpoints,
        "CA_FILE": secured.tls["ca"],
        "CERT_FILE": secured.tls["client"],
        "KEY_FILE": secured.tls["client-key"],
    }
    assert EtcdLockStore.check_config("etcd-tls", options) == []
    store, other = EtcdLockStore("etcd-tls", options), EtcdLockStore("etcd-tls2", options)
    try:
        assert store.acquire(key, "owner-a", "a", 30).fence is not None
        with other.watch(key) as waiter:
            deadline = time.monotonic() + 10
            while not other.push_wakeups:  # the watch goes over TLS too
                assert time.monotonic() < deadline, "the watch never started"
                time.sleep(0.02)
            waiter.poll()
            assert store.release(key, "owner-a")
            assert waiter.wait(5), "the release did not reach the other store's watch"
    finally:
        store.close()
        other.close()


def test_https_without_the_ca_or_without_a_client_certificate_is_unavailable(
    secured: Cluster, key: str
) -> None:
    assert secured.tls is not None
    for options, says in (
        ({}, "CERTIFICATE_VERIFY_FAILED"),  # the system's CAs do not know the test's CA
        ({"CA_FILE": secured.tls["ca"]}, "certificate required|alert|reset|EOF|Broken pipe"),
    ):
        store = EtcdLockStore("etcd-tls", {"ENDPOINTS": secured.endpoints, **options})
        try:
            with pytest.raises(LockStoreUnavailable, match=says):
                store.acquire(key, "owner-a", "a", 30)
        finally:
            store.close()
