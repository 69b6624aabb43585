"""@idempotent, its DRF mixin and middleware, run_once and @once, against the real stores."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.files.base import ContentFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.test.client import encode_multipart

from django_keel_lock import (
    LockStoreMisconfigured,
    LockUnavailable,
    idempotent,
    lock,
    once,
    run_once,
)
from django_keel_lock.checks import check_stores
from django_keel_lock.idempotency.storage import result_store_for
from django_keel_lock.models import IdempotentResult
from django_keel_lock.stores import DatabaseLockStore, RedisLockStore
from django_keel_lock.stores.database import results as database_results
from django_keel_lock.stores.memory_results import MemoryResults
from django_keel_lock.stores.results import ResultStore, StoredResult
from tests.conftest import (
    ALL_STORES,
    DATABASE_STORES,
    database_like,
    database_of,
    needs,
    serving,
    store_params,
)
from tests.support import idempotent_views as views
from tests.support.redis_servers import REDIS_SERVER, redis_cluster, redis_server
from tests.support.third_party_store import DictLockStore

pytestmark = pytest.mark.usefixtures("_urls")


@pytest.fixture
def _urls() -> Iterator[None]:
    views.CALLS.clear()
    views.GATE.clear()
    with override_settings(ROOT_URLCONF="tests.support.idempotent_views"):
        yield
    views.GATE.set()  # never leave a request thread blocked


def eventually(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(params=ALL_STORES)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def idem_key() -> str:
    return f"pay-{uuid.uuid4().hex}"


def post(client: Client, url: str, key: str | None, body: Any = None, **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    data = json.dumps(body if body is not None else {})
    return client.post(url, data, content_type="application/json", headers=headers)


def user(name: str) -> Any:
    return get_user_model().objects.create_user(f"{name}-{uuid.uuid4().hex[:10]}")


def logged_in(who: Any) -> Client:
    client = Client()
    client.force_login(who)
    return client


# -- the behaviour, on every store --------------------------------------------------------
def in_thread(fn: Any) -> threading.Thread:
    """A thread (not started) that runs `fn` and then closes its database connections."""

    def run() -> None:
        try:
            fn()
        finally:
            connections.close_all()

    return threading.Thread(target=run)


def send_together(url: str, key: str, body: Any, n: int = 10) -> tuple[list[Any], list[Any]]:
    """`n` POSTs of `body` with `key`, from `n` threads released at once: their responses,
    as they come, and the threads (started)."""
    answers: list[Any] = []
    start = threading.Barrier(n)

    def send() -> None:
        client = Client()
        start.wait()
        try:
            answers.append(post(client, url, key, body))
        finally:
            connections.close_all()  # the test client leaves a thread's connections open

    threads = [threading.Thread(target=send) for _ in range(n)]
    for thread in threads:
        thread.start()
    return answers, threads


def test_ten_concurrent_requests_run_the_view_once_the_others_get_409(
    alias: str, idem_key: str
) -> None:
    # The first holds on until the nine others have their answer: all of them came meanwhile.
    answers, threads = send_together(f"/{alias}/pay-global/", idem_key, {"gate": True})
    eventually(lambda: len(answers) == 9)
    views.GATE.set()
    for thread in threads:
        thread.join(30)
    assert views.CALLS[idem_key] == 1
    assert [response.status_code for response in answers] == [409] * 9 + [201]
    assert all(response["Retry-After"] == "1" for response in answers[:9])


def test_ten_concurrent_requests_that_wait_all_get_the_one_answer(
    alias: str, idem_key: str
) -> None:
    answers, threads = send_together(f"/{alias}/pay-wait/", idem_key, {"sleep": 0.3})
    for thread in threads:
        thread.join(30)
    assert views.CALLS[idem_key] == 1
    assert [response.status_code for response in answers] == [201] * 10
    assert len({response.content for response in answers}) == 1
    replayed = [response for response in answers if response.get("Idempotent-Replayed")]
    assert len(replayed) == 9


def test_replay_is_byte_identical_with_the_replay_header_and_safe_headers_only(
    alias: str, idem_key: str
) -> None:
    client = Client()
    first = post(client, f"/{alias}/pay-global/", idem_key, {"amount": 5})
    again = post(client, f"/{alias}/pay-global/", idem_key, {"amount": 5})
    assert views.CALLS[idem_key] == 1
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again["Idempotent-Replayed"] == "true"
    assert again["Content-Type"] == first["Content-Type"] == "application/json"
    assert again["Location"] == first["Location"]
    assert "Idempotent-Replayed" not in first
    assert "X-Internal" not in again and "secret" not in again.cookies


def test_the_same_key_with_another_body_or_path_gets_422(alias: str, idem_key: str) -> None:
    client = Client()
    assert post(client, f"/{alias}/pay-global/", idem_key, {"amount": 5}).status_code == 201
    assert post(client, f"/{alias}/pay-global/", idem_key, {"amount": 6}).status_code == 422
    other_path = client.post(
        f"/{alias}/pay-global/?x=1", "{}", content_type="application/json",
        headers={"Idempotency-Key": idem_key},
    )  # fmt: skip
    assert other_path.status_code == 422
    assert views.CALLS[idem_key] == 1


def test_5xx_and_exceptions_are_not_kept_and_the_key_is_free_at_once(
    alias: str, idem_key: str
) -> None:
    client = Client(raise_request_exception=False)
    failed = post(client, f"/{alias}/pay-global/", idem_key, {"status": 503})
    assert failed.status_code == 503
    assert post(client, f"/{alias}/pay-global/", idem_key, {"status": 503}).status_code == 201
    assert views.CALLS[idem_key] == 2

    raised_key = idem_key + "-raise"
    assert post(client, f"/{alias}/pay-global/", raised_key, {"raise": True}).status_code == 500
    assert not lock(f"idempotent:global:{raised_key}", store=alias).is_locked()
    assert post(client, f"/{alias}/pay-global/", raised_key, {"raise": True}).status_code == 201
    assert views.CALLS[raised_key] == 2


def test_4xx_is_kept_but_409_and_429_are_not(alias: str, idem_key: str) -> None:
    client = Client()
    for status, runs in ((400, 1), (409, 2), (429, 2)):
        key = f"{idem_key}-{status}"
        assert post(client, f"/{alias}/pay-global/", key, {"status": status}).status_code == status
        second = post(client, f"/{alias}/pay-global/", key, {"status": status})
        assert views.CALLS[key] == runs
        assert second.status_code == (status if runs == 1 else 201)


@pytest.mark.parametrize("alias", store_params(["sqlite", "postgres", "redis"]))
def test_under_atomic_requests_the_answer_is_kept_once_committed_and_not_on_rollback(
    alias: str, idem_key: str
) -> None:
    databases = ["default", "postgres"] if "postgres" in settings.DATABASES else ["default"]
    for database in databases:
        connections[database].settings_dict["ATOMIC_REQUESTS"] = True
    try:
        client = Client()
        first = post(client, f"/{alias}/pay-global/", idem_key)
        again = post(client, f"/{alias}/pay-global/", idem_key)
        assert again["Idempotent-Replayed"] == "true" and again.content == first.content
        rolled = idem_key + "-rollback"
        post(client, f"/{alias}/pay-global/", rolled, {"rollback": databases})
        second = post(client, f"/{alias}/pay-global/", rolled, {"rollback": databases})
        assert second.status_code == 201 and second.get("Idempotent-Replayed") is None
    finally:
        for database in databases:
            connections[database].settings_dict["ATOMIC_REQUESTS"] = False
    assert views.CALLS[idem_key] == 1 and views.CALLS[rolled] == 2


def test_a_result_expires_after_its_ttl(alias: str, idem_key: str) -> None:
    client = Client()
    post(client, f"/{alias}/pay-short/", idem_key)
    assert post(client, f"/{alias}/pay-short/", idem_key).get("Idempotent-Replayed") == "true"
    time.sleep(1.2)
    again = post(client, f"/{alias}/pay-short/", idem_key)
    assert again.get("Idempotent-Replayed") is None
    assert views.CALLS[idem_key] == 2


def test_user_a_key_never_replays_to_user_b(alias: str, idem_key: str) -> None:
    alice, bob = logged_in(user("alice")), logged_in(user("bob"))
    first = post(alice, f"/{alias}/pay/", idem_key, {"amount": 5})
    other = post(bob, f"/{alias}/pay/", idem_key, {"amount": 5})
    assert other.status_code == 201 and other.get("Idempotent-Replayed") is None
    assert other.content != first.content
    assert views.CALLS[idem_key] == 2
    assert post(alice, f"/{alias}/pay/", idem_key, {"amount": 5}).content == first.content


def test_a_holder_that_lost_its_lock_cannot_keep_its_response_over_the_new_holders(
    alias: str, idem_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The first run sleeps past its 0.3 s lock; a retry takes the key over and answers first.
    slow: list[Any] = []
    thread = in_thread(
        lambda: slow.append(post(Client(), f"/{alias}/pay-lost/", idem_key, {"first_sleep": 1.2}))
    )
    thread.start()
    eventually(lambda: views.CALLS[idem_key] == 1)  # the slow run has begun
    time.sleep(0.5)  # and its 0.3 s lock has expired
    taker = post(Client(), f"/{alias}/pay-lost/", idem_key, {"first_sleep": 1.2})
    with caplog.at_level(logging.WARNING, "django_keel_lock"):
        thread.join(10)
    assert views.CALLS[idem_key] == 2
    assert taker.get("Idempotent-Replayed") is None
    later = post(Client(), f"/{alias}/pay-lost/", idem_key, {"first_sleep": 1.2})
    assert later["Idempotent-Replayed"] == "true"
    assert later.content == taker.content != slow[0].content
    assert "the lock was lost while the view ran" in caplog.text


@pytest.mark.parametrize("alias", store_params(DATABASE_STORES))
def test_kept_under_debug_whose_cursor_formats_the_sql(alias: str, idem_key: str) -> None:
    client = Client()
    with override_settings(DEBUG=True):
        post(client, f"/{alias}/pay-global/", idem_key)
        assert post(client, f"/{alias}/pay-global/", idem_key)["Idempotent-Replayed"] == "true"


def test_results_are_fenced_in_the_store(alias: str, idem_key: str) -> None:
    """A writer whose lock expired and was taken over writes nothing, neither over the new
    holder's result nor before it."""
    results = result_store_for(alias)
    key = f"idempotent:test:{idem_key}"
    old = lock(key, store=alias, ttl=0.2)
    assert old.acquire()
    time.sleep(0.4)
    new = lock(key, store=alias, ttl=30)
    assert new.acquire()
    assert new.fence is not None and old.fence is not None and new.fence > old.fence
    mine = StoredResult(key, "fp", 0, 200, b"old")
    assert not results.save(key, old.owner or "", old.fence, mine, 60)
    theirs = StoredResult(key, "fp", 0, 201, b"new")
    assert results.save(key, new.owner or "", new.fence, theirs, 60)
    assert not results.save(key, new.owner or "", new.fence - 1, mine, 60)
    found = results.get(key)
    assert found is not None and (found.status, found.data) == (201, b"new")
    new.release()
    assert results.forget(key) and results.get(key) is None


def test_the_store_lists_its_results(alias: str, idem_key: str) -> None:
    client = Client()
    post(client, f"/{alias}/pay-global/", idem_key)
    listed = list(result_store_for(alias).iter_results(f"idempotent:global:{idem_key}"))
    assert [(r.key, r.status) for r in listed] == [(f"idempotent:global:{idem_key}", 201)]
    assert listed[0].size > 0 and listed[0].created_at is not None


# -- the edges, on a database and the memory store -----------------------------------------
EDGE_STORES = store_params(["memory", "postgres"])


@pytest.mark.parametrize("alias", EDGE_STORES)
@pytest.mark.parametrize(
    "value",
    ["x" * 201, "abc\x01def", "tab\there", "naïve", ""],
    ids=["too-long", "control", "tab", "non-ascii", "empty"],
)
def test_bad_keys_get_400(alias: str, value: str) -> None:
    client = Client()
    response = post(client, f"/{alias}/pay-global/", value)
    assert response.status_code == 400
    assert b"idempotency key" in response.content
    assert views.CALLS[value] == 0


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_missing_required_key_gets_400_and_an_optional_one_runs_the_view(alias: str) -> None:
    client = logged_in(user("carol"))
    missing = post(client, f"/{alias}/pay-required/", None, Accept="application/json")
    assert missing.status_code == 400 and "Idempotency-Key" in missing.json()["detail"]
    assert post(client, f"/{alias}/pay/", None).status_code == 201
    assert post(client, f"/{alias}/pay/", None).status_code == 201
    assert views.CALLS["-"] == 2


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_anonymous_without_a_session_gets_400_with_scope_user(alias: str, idem_key: str) -> None:
    response = post(Client(), f"/{alias}/pay/", idem_key)
    assert response.status_code == 400 and b"scope" in response.content


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_large_body_is_answered_but_not_kept_and_logged(
    alias: str, idem_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client()
    with caplog.at_level(logging.INFO, "django_keel_lock"):
        assert post(client, f"/{alias}/pay-small/", idem_key, {"size": 200}).status_code == 201
    assert "over max_body 100: not kept" in caplog.text
    assert post(client, f"/{alias}/pay-small/", idem_key, {"size": 200}).status_code == 201
    assert views.CALLS[idem_key] == 2


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_streaming_responses_are_not_kept_but_still_guarded(alias: str, idem_key: str) -> None:
    running: list[Any] = []
    url = f"/{alias}/stream/"
    thread = in_thread(lambda: running.append(post(Client(), url, idem_key, {"gate": True})))
    thread.start()
    eventually(lambda: views.CALLS[idem_key] == 1)  # the first is in the view
    assert post(Client(), url, idem_key, {"gate": True}).status_code == 409
    views.GATE.set()
    thread.join(10)
    assert b"".join(running[0].streaming_content) == b"ab"
    # Nothing was kept: the same request runs again, and another body is no 422.
    assert post(Client(), url, idem_key, {"gate": True}).streaming
    assert post(Client(), url, idem_key, {"other": 1}).streaming
    assert views.CALLS[idem_key] == 3


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_webhook_key_comes_from_the_url_and_the_body(alias: str) -> None:
    event = uuid.uuid4().hex
    client = Client()
    url = f"/{alias}/hooks/stripe/"
    first = client.post(url, json.dumps({"id": event}), content_type="application/json")
    again = client.post(url, json.dumps({"id": event}), content_type="application/json")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert views.CALLS[f"hook:{event}"] == 1
    no_id = client.post(url, json.dumps({"other": 1}), content_type="application/json")
    assert no_id.status_code == 400


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_class_based_view(alias: str, idem_key: str) -> None:
    client = Client()
    first = post(client, f"/{alias}/class/", idem_key)
    again = post(client, f"/{alias}/class/", idem_key)
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content


@pytest.mark.parametrize("alias", EDGE_STORES)
@pytest.mark.parametrize("view", ["async", "async-class"])
async def test_an_async_view(alias: str, view: str, idem_key: str) -> None:
    # async-class: a class-based view with async handlers, whose dispatch returns a
    # coroutine: it was "answered" (not an HttpResponse: not kept) before it ran.
    client = AsyncClient()
    headers = {"Idempotency-Key": idem_key}
    url = f"/{alias}/{view}/"
    try:
        first = await client.post(url, "{}", "application/json", headers=headers)
        again = await client.post(url, "{}", "application/json", headers=headers)
    finally:  # the thread the sync parts ran in keeps its connections otherwise
        await sync_to_async(connections.close_all)()
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content and views.CALLS[idem_key] == 1


@pytest.mark.parametrize("alias", EDGE_STORES)
async def test_an_async_request_cancelled_while_it_waits_for_the_key_leaves_it_free(
    alias: str, idem_key: str
) -> None:
    # The wait runs in a thread, which goes on when the request's task is cancelled: the key
    # it takes then must be given back, not left locked for lock_ttl with nobody to run.
    holder = lock(f"idempotent:global:{idem_key}", store=alias)
    assert await holder.aacquire()
    client = AsyncClient()
    request = asyncio.ensure_future(
        client.post(
            f"/{alias}/async-wait/", "{}", "application/json", headers={"Idempotency-Key": idem_key}
        )
    )
    try:
        await asyncio.sleep(0.5)  # the request waits for the key, in a thread
        request.cancel()
        await holder.arelease()  # the waiting thread takes the key now
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(request, 10)
        key = lock(f"idempotent:global:{idem_key}", store=alias)
        for _ in range(50):
            if not await key.ais_locked():
                break
            await asyncio.sleep(0.05)
        assert not await key.ais_locked(), "the cancelled request's key stayed locked"
        assert views.CALLS[idem_key] == 0
    finally:
        await sync_to_async(connections.close_all)()


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_get_requests_are_not_guarded(alias: str, idem_key: str) -> None:
    client = Client()
    for _ in range(2):
        client.get(f"/{alias}/pay-global/", headers={"Idempotency-Key": idem_key})
    assert views.CALLS[idem_key] == 2


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_the_drf_mixin_on_an_api_view(alias: str, idem_key: str) -> None:
    client = Client()
    first = post(client, f"/{alias}/drf/", idem_key, {"amount": 5})
    again = post(client, f"/{alias}/drf/", idem_key, {"amount": 5})
    assert first.status_code == 201 and first.json()["data"] == {"amount": 5}
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert post(client, f"/{alias}/drf/", idem_key, {"amount": 6}).status_code == 422
    assert post(client, f"/{alias}/drf/", None).status_code == 400
    assert views.CALLS[idem_key] == 1


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_the_middleware_guards_its_prefixes_only(alias: str, idem_key: str) -> None:
    with override_settings(
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django_keel_lock.idempotency.IdempotencyMiddleware",
        ],
        KEEL_LOCK_IDEMPOTENT_PATHS={f"/{alias}/mw/": {"store": alias, "scope": "global"}},
    ):
        client = Client()
        first = post(client, f"/{alias}/mw/pay/", idem_key)
        again = post(client, f"/{alias}/mw/pay/", idem_key)
        assert again["Idempotent-Replayed"] == "true" and again.content == first.content
        free = idem_key + "-free"
        post(client, f"/{alias}/free/pay/", free)
        assert post(client, f"/{alias}/free/pay/", free).get("Idempotent-Replayed") is None
    assert views.CALLS[idem_key] == 1 and views.CALLS[free] == 2


# -- manage.py locks results / forget, and the admin ------------------------------------------
def test_the_command_lists_results_and_forgets_one(alias: str, idem_key: str) -> None:
    client = Client()
    post(client, f"/{alias}/pay-global/", idem_key)
    key = f"idempotent:global:{idem_key}"
    out = io.StringIO()
    call_command("locks", "results", "--store", alias, "--prefix", key, stdout=out)
    header, row = out.getvalue().splitlines()
    assert header.split() == ["KEY", "STATUS", "AGE", "SIZE"]
    assert row.split()[:2] == [key, "201"] and int(row.split()[3]) > 0
    out = io.StringIO()
    call_command("locks", "results", "--store", alias, "--prefix", key, "--json", stdout=out)
    assert json.loads(out.getvalue())["key"] == key
    call_command("locks", "forget", key, "--store", alias, stdout=io.StringIO())
    with pytest.raises(CommandError) as missing:
        call_command("locks", "forget", key, "--store", alias, stdout=io.StringIO())
    assert missing.value.returncode == 1
    assert post(client, f"/{alias}/pay-global/", idem_key).get("Idempotent-Replayed") is None
    assert views.CALLS[idem_key] == 2


def test_the_admin_lists_results_without_bodies_and_deletes_one(idem_key: str) -> None:
    answered = post(Client(), "/sqlite/pay-global/", idem_key)  # the "default" store's database
    key = f"idempotent:global:{idem_key}"
    admin_user = get_user_model().objects.create_superuser(f"admin-{uuid.uuid4().hex[:10]}")
    browser = logged_in(admin_user)
    url = "/admin/django_keel_lock/idempotentresult/"
    page = browser.get(url, {"q": idem_key})
    assert page.status_code == 200 and key in page.content.decode()
    assert answered.json()["id"] not in page.content.decode()  # no body is shown
    deleted = browser.post(
        url,
        {"action": "delete_selected", "_selected_action": [key], "post": "yes"},
    )
    assert deleted.status_code == 302
    assert result_store_for("sqlite").get(key) is None


def test_the_middleware_setting_is_one_of_ours_for_check_w010() -> None:
    with override_settings(KEEL_LOCK_IDEMPOTENT_PATHS={"/api/": {}}):
        assert not [m for m in check_stores() if m.id == "django_keel_lock.W010"]


# -- run_once and @once --------------------------------------------------------------------
def test_run_once_runs_once_and_returns_the_stored_result(alias: str, idem_key: str) -> None:
    calls: list[int] = []

    def work() -> dict[str, Any]:
        calls.append(1)
        return {"charged": [1, 2]}

    assert run_once(idem_key, work, store=alias) == (True, {"charged": [1, 2]})
    assert run_once(idem_key, work, store=alias) == (False, {"charged": [1, 2]})
    assert len(calls) == 1


def test_run_once_keeps_nothing_when_fn_raises_and_refuses_while_running(
    alias: str, idem_key: str
) -> None:
    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_once(idem_key, fail, store=alias)
    assert run_once(idem_key, lambda: 7, store=alias) == (True, 7)
    running = lock(f"once:{idem_key}-busy", store=alias)
    assert running.acquire()
    try:
        with pytest.raises(LockUnavailable):
            run_once(f"{idem_key}-busy", lambda: 1, store=alias)
    finally:
        running.release()


@pytest.mark.parametrize("alias", store_params(["memory", "redis"]))
def test_once_decorator_formats_its_key_from_the_arguments(alias: str) -> None:
    seen: list[str] = []

    @once("webhook:test:{event_id}", ttl="1m", store=alias)
    def handle(event_id: str, amount: int) -> int:
        seen.append(event_id)
        return amount * 2

    event = uuid.uuid4().hex
    assert handle(event, 21) == 42
    assert handle(event, 21) == 42
    assert handle(event + "x", 1) == 2
    assert seen == [event, event + "x"]
    with pytest.raises(ValueError, match="event"):
        once("webhook:{missing}")(lambda event_id: None)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        run_once(uuid.uuid4().hex, lambda: {1, 2}, store=alias)


# -- options -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scope": "team"}, "scope must be"),
        ({"ttl": 0}, "ttl must be"),
        ({"wait": -1}, "wait must be"),
        ({"max_body": -1}, "max_body must be"),
        ({"statuses": [500]}, "5xx"),
        ({"methods": "POST"}, "methods must be"),
    ],
)
def test_bad_options_raise_at_decoration_naming_the_option(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        idempotent(**options)(lambda request: HttpResponse())


# -- Redis Cluster: each result in its lock's slot -------------------------------------------
@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_on_a_redis_cluster_each_result_lives_in_its_locks_slot() -> None:
    with redis_cluster(3) as nodes:
        store = RedisLockStore(
            f"cluster-{uuid.uuid4().hex[:8]}", {"URL": nodes[0].url, "CLUSTER": True}
        )
        with serving(store) as alias:
            keys = [f"order:{uuid.uuid4().hex}:{n}" for n in range(12)]
            for key in keys:  # keys in many slots: a CROSSSLOT script would fail here
                assert run_once(key, lambda key=key: key, store=alias) == (True, key)
                assert run_once(key, lambda: "again", store=alias) == (False, key)
            results = result_store_for(alias)
            client = store.client()
            for key in keys:
                lock_slot = client.keyslot(store.lock_name(f"once:{key}"))
                assert client.keyslot(store.lock_name(f"once:{key}") + ":result") == lock_slot
            listed = {result.key for result in results.iter_results("once:order:")}
            assert listed == {f"once:{key}" for key in keys}
            assert len({client.keyslot(store.lock_name(f"once:{k}")) for k in keys}) > 1


# -- a store of another package --------------------------------------------------------------
class DictStoreWithResults(DictLockStore):
    """A third party's store that keeps results: its `result_store()` hands one out."""

    def result_store(self) -> ResultStore:
        return MemoryResults(self)


def test_a_third_party_store_keeps_results_through_its_result_store_method(
    idem_key: str,
) -> None:
    with serving(DictStoreWithResults(f"dict-{uuid.uuid4().hex[:8]}")) as alias:
        assert run_once(idem_key, lambda: 1, store=alias) == (True, 1)
        assert run_once(idem_key, lambda: 2, store=alias) == (False, 1)


def test_a_store_without_a_result_store_is_refused_naming_the_way_out(idem_key: str) -> None:
    with serving(DictLockStore(f"dict-{uuid.uuid4().hex[:8]}")) as alias:
        with pytest.raises(LockStoreMisconfigured, match=r"result_store\(self\)"):
            run_once(idem_key, lambda: 1, store=alias)


# -- clean-up -------------------------------------------------------------------------------
@pytest.mark.parametrize("alias", store_params(DATABASE_STORES))
def test_expired_results_are_deleted_by_prune_and_by_the_writes(
    alias: str, idem_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = result_store_for(alias)
    key = f"idempotent:test:{idem_key}"

    def keep(name: str, ttl: float) -> None:
        handle = lock(name, store=alias, ttl=30)
        assert handle.acquire() and handle.owner is not None and handle.fence is not None
        kept = StoredResult(name, "fp", 0, 201, b"x")
        assert results.save(name, handle.owner, handle.fence, kept, ttl)
        handle.release()

    keep(key, 0.2)
    time.sleep(0.4)
    assert results.get(key) is None  # expired: not read, though its row is still there
    out = io.StringIO()
    call_command("locks", "results", "--store", alias, "--prune", "--prefix", key, stdout=out)
    assert "pruned" in out.getvalue() and not out.getvalue().startswith("pruned 0 ")
    assert not IdempotentResult.objects.using(database_of(alias)).filter(key=key).exists()

    # Every CLEAN_EVERY-th write of a process deletes expired rows (here: every write).
    monkeypatch.setattr(database_results, "CLEAN_EVERY", 1)
    keep(key + "-a", 0.2)
    time.sleep(0.4)
    keep(key + "-b", 60)
    rows = IdempotentResult.objects.using(database_of(alias)).filter(key__startswith=key)
    assert list(rows.values_list("key", flat=True)) == [key + "-b"]


# -- found in review: each failed before its fix --------------------------------------------
@pytest.mark.parametrize("alias", store_params(["mariadb"]))
def test_a_waiting_duplicate_whose_transaction_read_first_gets_the_replay_not_a_second_run(
    alias: str, idem_key: str
) -> None:
    # ATOMIC_REQUESTS with OPTIONS isolation_level "repeatable read" (InnoDB's own default;
    # Django's is read committed): the duplicate's transaction reads (its scope's tenant
    # lookup) before it waits for the key; the result kept meanwhile must be read past that
    # snapshot, or the view runs twice.
    database = database_of(alias)
    saved = connections[database].settings_dict["OPTIONS"]
    connections[database].settings_dict["OPTIONS"] = {**saved, "isolation_level": "repeatable read"}
    connections[database].settings_dict["ATOMIC_REQUESTS"] = True
    connections[database].close()  # this thread's reconnects with the isolation level
    url, body = f"/{alias}/pay-wait-tenant/", {"first_sleep": 1}
    try:
        first: list[Any] = []
        thread = in_thread(
            lambda: first.append(post(Client(), url, idem_key, body, X_Database=database))
        )
        thread.start()
        eventually(lambda: views.CALLS[idem_key] == 1)  # the first is in the view
        again = post(Client(), url, idem_key, body, X_Database=database)
        thread.join(10)
    finally:
        connections[database].settings_dict["ATOMIC_REQUESTS"] = False
        connections[database].settings_dict["OPTIONS"] = saved
        connections[database].close()
    assert views.CALLS[idem_key] == 1
    assert again["Idempotent-Replayed"] == "true" and again.content == first[0].content


@pytest.mark.parametrize("alias", store_params(["mariadb"]))
def test_results_live_their_ttl_on_a_mariadb_whose_session_time_zone_is_not_utc(
    alias: str, idem_key: str
) -> None:
    base = database_of(alias)
    options = {**connections.settings[base].get("OPTIONS", {})}
    options["init_command"] = "SET time_zone = '+05:00'"
    with database_like(base, f"tz_{os.getpid()}", OPTIONS=options) as database:
        store = DatabaseLockStore(f"tz-{uuid.uuid4().hex[:8]}", {"DATABASE": database})
        with serving(store) as tz_alias:
            assert run_once(idem_key, lambda: 1, store=tz_alias, ttl="1h") == (True, 1)
            assert run_once(idem_key, lambda: 2, store=tz_alias, ttl="1h") == (False, 1)
            results = result_store_for(tz_alias)
            assert [r.key for r in results.iter_results(f"once:{idem_key}")] == [f"once:{idem_key}"]
            results.prune()
            assert results.get(f"once:{idem_key}") is not None


def csrf_client() -> tuple[Client, str]:
    """A client that passes CSRF checks the way a browser does (cookie and header)."""
    client = Client(enforce_csrf_checks=True)
    secret = uuid.uuid4().hex  # 32 letters and digits: a CSRF secret
    client.cookies["csrftoken"] = secret
    return client, secret


def upload(client: Client, secret: str, url: str, key: str, boundary: str, content: bytes) -> Any:
    body = encode_multipart(
        boundary, {"note": "scan", "file": ContentFile(content, name="scan.pdf")}
    )
    return client.post(
        url,
        body,
        content_type=f"multipart/form-data; boundary={boundary}",
        headers={"Idempotency-Key": key, "X-CSRFToken": secret},
    )


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_multipart_upload_read_by_csrf_first_is_kept_and_replayed_whatever_its_boundary(
    alias: str, idem_key: str
) -> None:
    # CsrfViewMiddleware reads request.POST first: a multipart body is then consumed, and a
    # browser (or requests) sends each retry with a new random boundary.
    client, secret = csrf_client()
    url = f"/{alias}/upload/"
    first = upload(client, secret, url, idem_key, "boundary-one", b"%PDF" * 100)
    again = upload(client, secret, url, idem_key, "boundary-two", b"%PDF" * 100)
    assert first.status_code == 201 and first.json()["note"] == "scan"
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert upload(client, secret, url, idem_key, "three", b"other").status_code == 422
    assert views.CALLS[idem_key] == 1


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_an_upload_over_data_upload_max_memory_size_is_not_refused(
    alias: str, idem_key: str
) -> None:
    # Files are not held by DATA_UPLOAD_MAX_MEMORY_SIZE; reading request.body is.
    _, secret = csrf_client()
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        first = upload(Client(), secret, f"/{alias}/upload/", idem_key, "b1", b"x" * 5000)
        again = upload(Client(), secret, f"/{alias}/upload/", idem_key, "b2", b"x" * 5000)
    assert first.status_code == 201, first.content
    assert again["Idempotent-Replayed"] == "true" and views.CALLS[idem_key] == 1


def test_the_same_bytes_under_another_content_type_get_422(idem_key: str) -> None:
    # What the view reads of a body depends on its type (request.POST of a form; none of
    # text/plain): a retry is the same request only with the same type.
    client = Client()
    headers = {"Idempotency-Key": idem_key}
    form = "application/x-www-form-urlencoded"
    assert client.post("/memory/pay-global/", "{}", form, headers=headers).status_code == 201
    other = client.post("/memory/pay-global/", "{}", "text/plain", headers=headers)
    assert other.status_code == 422 and views.CALLS[idem_key] == 1
    charset = client.post("/memory/pay-global/", "{}", f"{form}; charset=utf-8", headers=headers)
    assert charset.status_code == 422  # a charset changes what request.POST decodes


def test_a_scope_and_a_key_that_join_alike_never_share_a_result(idem_key: str) -> None:
    view = idempotent(store="memory", scope=lambda request: request.headers["X-Tenant"])(views.pay)

    def send(tenant: str, key: str) -> Any:
        headers = {"Idempotency-Key": key, "X-Tenant": tenant}
        return view(RequestFactory().post("/pay/", "{}", "application/json", headers=headers))

    first = send("acme:1", idem_key)
    other = send("acme", f"1:{idem_key}")  # joined with ":", both read acme:1:<key>
    assert other.status_code == 201 and other.get("Idempotent-Replayed") is None
    assert other.content != first.content and views.CALLS[f"1:{idem_key}"] == 1


def factory_post(key: str) -> HttpRequest:
    return RequestFactory().post(
        "/pay/", "{}", "application/json", headers={"Idempotency-Key": key}
    )


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_a_store_outage_before_the_view_answers_503_and_runs_nothing(idem_key: str) -> None:
    with redis_server() as server:
        store = RedisLockStore(f"down-{uuid.uuid4().hex[:8]}", {"URL": server.url})
        with serving(store) as alias:
            view = idempotent(store=alias, scope="global")(views.pay)
            server.kill()
            response = view(factory_post(idem_key))
    assert response.status_code == 503 and response["Retry-After"] == "1"
    assert b"store" in response.content and views.CALLS[idem_key] == 0


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_a_store_outage_after_the_view_ran_returns_its_answer_and_says_it_is_not_kept(
    idem_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with redis_server() as server:
        store = RedisLockStore(f"down-{uuid.uuid4().hex[:8]}", {"URL": server.url})

        def pay_then_outage(request: HttpRequest) -> HttpResponse:
            response = views.pay(request)
            server.kill()  # the store goes away between the view and the keeping
            return response

        with serving(store) as alias:
            view = idempotent(store=alias, scope="global")(pay_then_outage)
            with caplog.at_level(logging.WARNING, "django_keel_lock"):
                response = view(factory_post(idem_key))
    assert response.status_code == 201 and views.CALLS[idem_key] == 1
    assert "not kept" in caplog.text


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_the_middleware_keeps_no_answer_that_never_reached_the_view(
    alias: str, idem_key: str
) -> None:
    # CsrfViewMiddleware refuses in process_view, inside the middleware's call: its 403 was
    # kept, and the retry with the token got it back for 24 h. A path no view has, likewise.
    with override_settings(
        MIDDLEWARE=[*settings.MIDDLEWARE, "django_keel_lock.idempotency.IdempotencyMiddleware"],
        KEEL_LOCK_IDEMPOTENT_PATHS={f"/{alias}/": {"store": alias, "scope": "global"}},
    ):
        client, secret = csrf_client()
        assert post(client, f"/{alias}/mw/pay/", idem_key).status_code == 403
        accepted = post(client, f"/{alias}/mw/pay/", idem_key, X_CSRFToken=secret)
        assert accepted.status_code == 201 and accepted.get("Idempotent-Replayed") is None
        missing = idem_key + "-404"
        nowhere = post(client, f"/{alias}/no-such-view/", missing, X_CSRFToken=secret)
        assert nowhere.status_code == 404
        assert not list(result_store_for(alias).iter_results(f"idempotent:global:{missing}"))
    assert views.CALLS[idem_key] == 1


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_decorated_view_under_a_middleware_prefix_runs_once_not_409(
    alias: str, idem_key: str
) -> None:
    # Both took the same key's lock, one inside the other: the inner always answered 409.
    with override_settings(
        MIDDLEWARE=[*settings.MIDDLEWARE, "django_keel_lock.idempotency.IdempotencyMiddleware"],
        KEEL_LOCK_IDEMPOTENT_PATHS={f"/{alias}/": {"store": alias, "scope": "global"}},
    ):
        client = Client()
        first = post(client, f"/{alias}/pay-global/", idem_key)
        again = post(client, f"/{alias}/pay-global/", idem_key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert views.CALLS[idem_key] == 1


@pytest.mark.parametrize("alias", EDGE_STORES)
def test_a_drf_key_template_reads_a_json_body_sent_with_a_charset(alias: str) -> None:
    # DRF's request.content_type is the whole header: "application/json; charset=utf-8" was
    # not read as JSON, and every such event got 400 (no {id}).
    event = uuid.uuid4().hex
    client = Client()
    url, body = f"/{alias}/drf-hook/", json.dumps({"id": event})
    first = client.post(url, body, content_type="application/json; charset=utf-8")
    again = client.post(url, body, content_type="application/json; charset=utf-8")
    assert first.status_code == 200, first.content
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert views.CALLS[f"drf-hook:{event}"] == 1


@pytest.mark.parametrize("alias", store_params(["mariadb"]))
def test_the_admin_lists_live_results_on_a_mariadb_whose_session_time_zone_is_not_utc(
    alias: str, idem_key: str
) -> None:
    base = database_of(alias)
    options = {**connections.settings[base].get("OPTIONS", {})}
    options["init_command"] = "SET time_zone = '+05:00'"
    admin_user = get_user_model().objects.create_superuser(f"admin-{uuid.uuid4().hex[:10]}")
    with database_like(base, f"tz_{os.getpid()}", OPTIONS=options) as database:
        backend = "django_keel_lock.stores.DatabaseLockStore"
        stores = {"default": {"BACKEND": backend, "OPTIONS": {"DATABASE": database}}}
        with override_settings(KEEL_LOCK_STORES=stores):
            assert run_once(idem_key, lambda: 1, ttl="1h") == (True, 1)
            page = logged_in(admin_user).get(
                "/admin/django_keel_lock/idempotentresult/", {"q": idem_key}
            )
    assert page.status_code == 200 and f"once:{idem_key}" in page.content.decode()


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_run_once_whose_result_cannot_be_kept_returns_it_and_says_so(
    idem_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # fn ran: raising LockStoreUnavailable now hid its result and had a task retry (run) it.
    with redis_server() as server:
        store = RedisLockStore(f"down-{uuid.uuid4().hex[:8]}", {"URL": server.url})

        def charge() -> dict[str, int]:
            server.kill()  # the store goes away while the function runs
            return {"charged": 1}

        with serving(store) as alias, caplog.at_level(logging.WARNING, "django_keel_lock"):
            assert run_once(idem_key, charge, store=alias) == (True, {"charged": 1})
    assert "not kept" in caplog.text


def test_a_replay_of_a_compressed_body_says_it_is_compressed(idem_key: str) -> None:
    # The middleware outside GZipMiddleware keeps the gzipped bytes: without their
    # Content-Encoding, the replay was gzip a client read as JSON.
    with override_settings(
        MIDDLEWARE=[
            "django_keel_lock.idempotency.IdempotencyMiddleware",
            "django.middleware.gzip.GZipMiddleware",
            *settings.MIDDLEWARE,
        ],
        KEEL_LOCK_IDEMPOTENT_PATHS={"/memory/mw/": {"store": "memory", "scope": "global"}},
    ):
        client = Client(headers={"Accept-Encoding": "gzip"})
        first = post(client, "/memory/mw/pay/", idem_key, {"size": 2000})
        again = post(client, "/memory/mw/pay/", idem_key, {"size": 2000})
    assert first["Content-Encoding"] == "gzip" and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content and again.get("Content-Encoding") == "gzip"
