"""What an idempotent request costs in round trips to its store, counted on the connections
of a store of the test's own through a counting proxy (tests/support/round_trips.py): the
first request of a key at most one more than the same view under `@lock_view`, and a replay
fewer than the first. The read of the result and the write of the response each release the
lock in the same store operation (`ResultStore.get_releasing`, `save_releasing`)."""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.test import RequestFactory

from django_keel_lock import idempotent, lock, lock_view, set_lock_store
from django_keel_lock.idempotency.storage import keep_releasing, result_store_for, take_kept
from django_keel_lock.signals import lock_released
from django_keel_lock.stores import DatabaseLockStore, RedisLockStore
from django_keel_lock.stores.base import LockStore
from django_keel_lock.stores.results import StoredResult
from tests.conftest import skip_or_fail, store_params
from tests.support.round_trips import RoundTrips, round_trips

BODY = json.dumps({"amount": 1250})


def answer(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"id": "pay_1"}, status=201)


def _redis(proxy: RoundTrips, alias: str) -> LockStore:
    db = urlsplit(settings.REDIS_URL).path or "/0"
    return RedisLockStore(alias, {"URL": f"redis://127.0.0.1:{proxy.port}{db}"})


def _postgres(proxy: RoundTrips, alias: str) -> LockStore:
    connections.settings[alias] = {
        **connections.settings["postgres"], "HOST": "127.0.0.1", "PORT": str(proxy.port),
    }  # fmt: skip
    # The proxy is no pooler: the store keeps its prepared statements as direct.
    return DatabaseLockStore(alias, {"DATABASE": alias, "TRANSACTION_POOLER": False})


def _target(kind: str) -> tuple[str, int]:
    if kind == "redis":
        url = urlsplit(settings.REDIS_URL)
        return url.hostname or "127.0.0.1", url.port or 6379
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    db = connections.settings["postgres"]
    return db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432)


@pytest.fixture
def counted(request: pytest.FixtureRequest, _databases: None) -> Iterator[tuple[str, RoundTrips]]:
    """(alias, proxy): a lock store of kind `request.param` whose connections go through
    the proxy, under an alias of its own."""
    kind = request.param
    alias = f"rt-{kind}-{uuid.uuid4().hex[:6]}"
    with round_trips(*_target(kind)) as proxy:
        store = (_redis if kind == "redis" else _postgres)(proxy, alias)
        set_lock_store(store, alias)
        try:
            yield alias, proxy
        finally:
            set_lock_store(None, alias)
            store.close()
            if alias in connections.settings:
                connections[alias].close()
                del connections[alias]
                del connections.settings[alias]


def _per_request(proxy: RoundTrips, send: Callable[[], Any], times: int = 5) -> float:
    """The median round trips of one `send()`, after two not counted (scripts loaded,
    statements prepared)."""
    send(), send()
    counts = []
    for _ in range(times):
        before = proxy.count
        send()
        counts.append(proxy.count - before)
    return statistics.median(counts)


@pytest.mark.parametrize("counted", store_params(["redis", "postgres"]), indirect=True)
def test_a_first_request_costs_one_round_trip_more_than_lock_view_and_a_replay_fewer(
    counted: tuple[str, RoundTrips],
) -> None:
    alias, proxy = counted
    factory = RequestFactory()
    run = uuid.uuid4().hex

    def post(key: str | None = None) -> HttpRequest:
        headers = {} if key is None else {"Idempotency-Key": key}
        return factory.post("/pay/", BODY, content_type="application/json", headers=headers)

    locked = lock_view(f"rt:{run}", store=alias)(answer)
    guarded = idempotent(store=alias, scope="global", ttl="10m")(answer)
    keys = iter(range(10**6))

    def first() -> None:
        response = guarded(post(f"rt-{run}-{next(keys)}"))
        assert response.status_code == 201 and "Idempotent-Replayed" not in response

    def replay() -> None:
        response = guarded(post(f"rt-{run}-replayed"))
        assert response["Idempotent-Replayed"] == "true"

    guarded(post(f"rt-{run}-replayed"))
    with_lock_view = _per_request(proxy, lambda: locked(post()))
    first_request = _per_request(proxy, first)
    a_replay = _per_request(proxy, replay)
    counts = (with_lock_view, first_request, a_replay)
    assert with_lock_view == 2, counts  # acquire, release
    assert first_request <= with_lock_view + 1, counts
    assert a_replay < first_request, counts


@pytest.fixture(params=store_params(["memory", "sqlite", "postgres", "mariadb", "redis"]))
def alias(request: pytest.FixtureRequest, _databases: None) -> str:
    return str(request.param)


def test_a_lost_holders_keep_and_release_writes_nothing_and_leaves_the_new_holder_its_lock(
    alias: str,
) -> None:
    """The fused write (`save_releasing`) of a holder whose lock expired and was taken over
    neither keeps its result nor releases the new holder's lock; the new holder's does
    both, and its handle ends released (a third acquire gets the key at once)."""
    results = result_store_for(alias)
    key = f"idempotent:test:fused:{uuid.uuid4().hex}"
    old = lock(key, store=alias, ttl=0.2)
    assert old.acquire()
    time.sleep(0.4)
    new = lock(key, store=alias, ttl=30)
    assert new.acquire() and old.fence is not None
    assert not keep_releasing(old, results, StoredResult(key, "fp", 0, 200, b"old"), 60)
    assert old.lost and not old.held
    assert new.is_owned() and results.get(key) is None
    assert keep_releasing(new, results, StoredResult(key, "fp", 0, 201, b"new"), 60)
    assert not new.held and not new.lost
    found = results.get(key)
    assert found is not None and (found.status, found.data) == (201, b"new")
    third = lock(key, store=alias, ttl=30)
    assert third.acquire(timeout=0)
    assert take_kept(third, results) == found  # read, and released in the same operation
    assert not third.held and not third.lost
    assert lock(key, store=alias).acquire(timeout=0)


def test_release_with_refuses_a_handle_with_auto_extend_naming_the_way_out() -> None:
    handle = lock(f"test:fused:{uuid.uuid4().hex}", store="memory", auto_extend=True)
    assert handle.acquire()
    try:
        with pytest.raises(ValueError, match=r"call release\(\) instead"):
            handle.release_with(lambda key, owner: True)
    finally:
        handle.release()


def test_a_fused_keep_and_release_ends_the_handle_as_a_release_does(alias: str) -> None:
    """`lock_released` is sent with the handle, and a waiter of this process, waiting for
    the key in its line, gets it."""
    results = result_store_for(alias)
    key = f"idempotent:test:fused-signal:{uuid.uuid4().hex}"
    sent: list[Any] = []

    def receiver(sender: Any, lock: Any, **kwargs: Any) -> None:
        sent.append(lock)

    holder = lock(key, store=alias, ttl=60)
    assert holder.acquire()
    got: list[bool] = []
    waiter = threading.Thread(
        target=lambda: got.append(lock(key, store=alias, ttl=5).acquire(timeout=30))
    )
    lock_released.connect(receiver)
    try:
        waiter.start()
        time.sleep(0.3)  # the waiter stands in the key's line (no assert rests on it)
        assert keep_releasing(holder, results, StoredResult(key, "fp", 0, 201, b"x"), 60)
        waiter.join(40)
    finally:
        lock_released.disconnect(receiver)
    assert sent[:1] == [holder] and not holder.held
    assert got == [True]
