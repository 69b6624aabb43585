"""@lock_view and LockViewMixin on sync, async and class-based views, against real stores."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, override_settings

from django_keel_lock import (
    Lock,
    LockNotHeldError,
    LockStoreUnavailable,
    get_lock_store,
    lock,
    lock_view,
)
from django_keel_lock.conf import conf
from django_keel_lock.views import parse_key_template, render_key_template, wants_json
from tests.conftest import ALL_STORES, store_params
from tests.support.holders import held_elsewhere
from tests.testapp import views

JSON = {"Accept": "application/json"}
# A Redis URL store on a port nothing listens on: every call is an outage.
DOWN_STORES = {"down": {"BACKEND": "django_keel_lock.stores.RedisLockStore",
                        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}}  # fmt: skip


@pytest.fixture(autouse=True)
def _reset_views() -> Iterator[None]:
    views.CALLS.clear()
    views.GATE.clear()
    views.ENTERED.clear()
    views.TAKEN.clear()
    yield
    views.GATE.set()  # never leave a request thread blocked


def hold(key: str, ttl: float = 60, store: str = "memory") -> Lock:
    handle = lock(key, ttl=ttl, store=store, holder="someone-else:1")
    assert handle.acquire()
    return handle


def is_free(key: str, store: str = "memory") -> bool:
    return not lock(key, store=store).is_locked()


# -- key templates --------------------------------------------------------------------------
def test_placeholders_are_filled_from_url_kwargs_as_given() -> None:
    assert render_key_template("invoice:<pk>", {"pk": 42}) == "invoice:42"
    # Braces and percent signs are not formatting: values and literals are used as given.
    assert render_key_template("a{0}:<x>:%s", {"x": "{y}<z>"}) == "a{0}:{y}<z>:%s"


@pytest.mark.parametrize("template", ["a<b", "a>b", "x:<pk>>", "<1pk>", "<>", "<a b>"])
def test_bad_template_is_rejected_when_decorating(template: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="placeholder"):
        lock_view(template)


def test_template_parts() -> None:
    assert parse_key_template("inv:<pk>:<slug>") == (
        (False, "inv:"), (True, "pk"), (False, ":"), (True, "slug"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"key": 42}, TypeError),
        ({"key": "k", "on_locked": "skip"}, TypeError),
        ({"key": "k", "ttl": -1}, ValueError),
        ({"key": "k", "timeout": "soon"}, ValueError),
        ({"key": "k", "store": 3}, TypeError),
    ],
)
def test_bad_arguments_fail_at_decoration(kwargs: dict[str, Any], error: type[Exception]) -> None:
    key = kwargs.pop("key")
    with pytest.raises(error):
        lock_view(key, **kwargs)


def test_unknown_placeholder_raises_improperly_configured_naming_it(client: Client) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"<nope>.*URL kwargs: key"):
        client.get("/views/bad-placeholder/anything/")
    assert views.CALLS == []


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        ("", False),
        ("*/*", False),
        ("text/html,application/xhtml+xml,*/*;q=0.8", False),
        ("application/json", True),
        ("text/html, application/json;q=0.5", True),
        ("application/problem+json", True),
        ("application/json;q=0", False),
        ("application/json;q=bogus", False),
    ],
)
def test_json_only_for_clients_that_ask_for_it(accept: str, expected: bool) -> None:
    request = HttpRequest()
    if accept:
        request.META["HTTP_ACCEPT"] = accept
    assert wants_json(request) is expected


# -- sync function views --------------------------------------------------------------------
def test_free_key_runs_the_view_and_releases_the_lock(client: Client) -> None:
    pk = random.randrange(10**9)
    response = client.get(f"/views/charge/{pk}/")
    assert response.status_code == 200
    assert views.CALLS == ["charge"]
    # The view saw its own held lock as request.keel_lock, fence and all.
    assert response.json()["held"] == "True" and response.json()["fence"].isdigit()
    assert is_free(f"invoice:{pk}")


def test_held_key_answers_409_text_with_retry_after_rounded_up(client: Client) -> None:
    pk = random.randrange(10**9)
    holder = hold(f"invoice:{pk}", ttl=7.2)
    try:
        response = client.get(f"/views/charge/{pk}/")
    finally:
        holder.release()
    assert response.status_code == 409
    assert response["Retry-After"] == "8"  # 7.19...s left, rounded up
    assert response["Content-Type"].startswith("text/plain")
    assert f"invoice:{pk}" in response.content.decode()
    assert views.CALLS == []
    assert client.get(f"/views/charge/{pk}/").status_code == 200


def test_held_key_answers_json_when_the_client_accepts_json(client: Client) -> None:
    pk = random.randrange(10**9)
    holder = hold(f"invoice:{pk}", ttl=120)
    try:
        response = client.get(f"/views/charge/{pk}/", headers=JSON)
    finally:
        holder.release()
    assert response.status_code == 409
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert body["key"] == f"invoice:{pk}" and body["detail"]
    assert set(body) == {"detail", "key"}
    assert response["Retry-After"] == "120"


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_lock_held_by_another_process_answers_409_in_every_store(
    client: Client, store_alias: str, key: str
) -> None:
    url = f"/views/store/{store_alias}/{key}/"
    with held_elsewhere(store_alias, key, ttl=30):
        response = client.get(url, headers=JSON)
        assert response.status_code == 409, response.content
        assert 25 <= int(response["Retry-After"]) <= 30
        assert response.json()["key"] == key
        assert views.CALLS == []
    response = client.get(url)
    assert response.status_code == 200
    assert views.CALLS == ["store_view"]
    assert is_free(key, store_alias)


def test_callable_key(client: Client, key: str) -> None:
    holder = hold(f"callable:{key}")
    try:
        assert client.get(f"/views/callable/{key}/").status_code == 409
    finally:
        holder.release()
    assert client.get(f"/views/callable/{key}/").status_code == 200
    assert views.CALLS == ["by_callable"]


def test_on_locked_answers_instead_of_409(client: Client, key: str) -> None:
    holder = hold(key)
    try:
        response = client.get(f"/views/custom/{key}/")
    finally:
        holder.release()
    assert response.status_code == 423
    assert response.content.decode() == f"busy {key}"
    assert views.CALLS == []


def test_timeout_waits_for_the_holder_then_runs(client: Client, key: str) -> None:
    holder = hold(key)
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    started = time.monotonic()
    response = client.get(f"/views/waits/{key}/")
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.25
    assert views.CALLS == ["waits"]


def test_concurrent_request_gets_409_while_the_first_runs(client: Client, key: str) -> None:
    first: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: first.update(r=Client().get(f"/views/slow/{key}/")))
    thread.start()
    try:
        assert views.ENTERED.wait(5)
        info = lock(key, store="memory").info()
        # The URL pattern, not the path: paths carry secrets and whatever a client typed.
        assert info is not None and info.holder.endswith(" GET views/slow/<path:key>/")
        second = client.get(f"/views/slow/{key}/")
        assert second.status_code == 409
        assert 55 <= int(second["Retry-After"]) <= 60
    finally:
        views.GATE.set()
        thread.join(5)
    assert first["r"].status_code == 200
    assert views.CALLS == ["slow"]
    assert is_free(key)


def test_lock_is_released_when_the_view_raises(client: Client, key: str) -> None:
    with pytest.raises(views.Boom):
        client.get(f"/views/boom/{key}/")
    assert views.CALLS == ["boom"]
    assert is_free(key)


@override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES})
def test_store_outage_is_a_500_not_a_409(key: str) -> None:
    with pytest.raises(LockStoreUnavailable):
        Client().get(f"/views/store/down/{key}/")
    response = Client(raise_request_exception=False).get(f"/views/store/down/{key}/")
    assert response.status_code == 500
    assert views.CALLS == []


# -- auto_extend and max_hold ---------------------------------------------------------------
EXTEND_STORES = store_params(["memory", "postgres"])


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_auto_extend_keeps_the_lock_while_the_view_outlives_its_ttl(
    client: Client, store_alias: str, key: str
) -> None:
    response = client.get(f"/views/extending/auto-extend/{store_alias}/{key}/")
    assert response.status_code == 200  # no LockNotHeldError
    assert views.TAKEN == []
    assert views.CALLS == ["extending"]
    assert is_free(key, store_alias)


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_without_auto_extend_the_view_loses_the_lock_at_its_ttl(
    client: Client, store_alias: str, key: str
) -> None:
    with pytest.raises(LockNotHeldError):
        client.get(f"/views/extending/no-extend/{store_alias}/{key}/")
    assert len(views.TAKEN) == 1
    assert views.EXTEND_TTL * 0.9 <= views.TAKEN[0] < views.EXTEND_TTL + 0.4


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_max_hold_stops_the_renewal_and_the_view_loses_the_lock(
    client: Client, store_alias: str, key: str
) -> None:
    with pytest.raises(LockNotHeldError, match="max_hold"):
        client.get(f"/views/extending/max-hold/{store_alias}/{key}/")
    # Kept past its ttl, lost at max_hold.
    assert len(views.TAKEN) == 1
    assert views.EXTEND_MAX_HOLD * 0.9 <= views.TAKEN[0] < views.EXTEND_MAX_HOLD + 0.4


def test_mixin_passes_lock_auto_extend_and_lock_max_hold(client: Client, key: str) -> None:
    response = client.get(f"/views/mixin-extend/{key}/")
    assert response.json() == {"ran": "mixin_extend", "auto_extend": "True", "max_hold": "300.0"}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"auto_extend": "yes"}, TypeError, "auto_extend must be True or False, got 'yes'"),
        ({"max_hold": 60}, ValueError, "max_hold caps how long auto_extend keeps a lock alive"),
        ({"auto_extend": True, "max_hold": 0}, ValueError, "max_hold must be > 0"),
    ],
)
def test_bad_auto_extend_and_max_hold_fail_at_decoration_naming_them(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        lock_view("k", **kwargs)


# -- async function views -------------------------------------------------------------------
def test_decorated_async_view_stays_a_coroutine_function() -> None:
    assert iscoroutinefunction(views.aview)
    assert not iscoroutinefunction(views.charge)


async def test_async_view_runs_when_free_and_releases(async_client: AsyncClient, key: str) -> None:
    response = await async_client.get(f"/views/async/{key}/")
    assert response.status_code == 200
    assert views.CALLS == ["aview"]
    assert response.json()["held"] == "True" and response.json()["fence"].isdigit()
    assert is_free(key)


async def test_async_view_answers_409_while_held(async_client: AsyncClient, key: str) -> None:
    holder = hold(key, ttl=42)
    try:
        response = await async_client.get(f"/views/async/{key}/", headers=JSON)
    finally:
        holder.release()
    assert response.status_code == 409
    assert response["Retry-After"] == "42"
    assert response.json() == {"detail": response.json()["detail"], "key": key}
    assert views.CALLS == []


async def test_async_on_locked_may_be_async(async_client: AsyncClient, key: str) -> None:
    holder = hold(key)
    try:
        response = await async_client.get(f"/views/async-custom/{key}/")
    finally:
        holder.release()
    assert response.status_code == 423
    assert response.content.decode() == f"async busy {key}"


@pytest.mark.parametrize("store_alias", ALL_STORES)
async def test_async_view_lock_held_by_another_process_in_every_store(
    async_client: AsyncClient, store_alias: str, key: str
) -> None:
    url = f"/views/astore/{store_alias}/{key}/"
    with held_elsewhere(store_alias, key, ttl=30):
        response = await async_client.get(url)
        assert response.status_code == 409
        assert 25 <= int(response["Retry-After"]) <= 30
        assert response["Content-Type"].startswith("text/plain")
    response = await async_client.get(url)
    assert response.status_code == 200
    assert views.CALLS == ["astore_view"]
    assert await sync_to_async(is_free)(key, store_alias)


# -- Retry-After when readers keep a writer out ---------------------------------------------
MODAL_STORES = store_params(["memory", "sqlite", "postgres", "mariadb", "redis"])
READER_TTLS = (5, 300)


@pytest.mark.parametrize("store_alias", MODAL_STORES)
def test_a_writer_kept_out_by_readers_is_told_to_retry_after_the_last_reader(
    client: Client, store_alias: str, key: str
) -> None:
    readers = [lock(key, shared=True, ttl=ttl, store=store_alias) for ttl in READER_TTLS]
    assert all(reader.acquire() for reader in readers)
    try:
        response = client.get(f"/views/store/{store_alias}/{key}/")
        assert response.status_code == 409, response.content
        # The writer needs both readers gone: the 300 s one, not the 5 s one.
        assert 200 < int(response["Retry-After"]) <= 300
        assert views.CALLS == []
    finally:
        for reader in readers:
            reader.release()


@pytest.mark.parametrize("store_alias", MODAL_STORES)
async def test_an_async_writer_kept_out_by_readers_is_told_to_retry_after_the_last_reader(
    async_client: AsyncClient, store_alias: str, key: str
) -> None:
    readers = [lock(key, shared=True, ttl=ttl, store=store_alias) for ttl in READER_TTLS]
    assert all([await reader.aacquire() for reader in readers])
    try:
        response = await async_client.get(f"/views/astore/{store_alias}/{key}/")
        assert response.status_code == 409, response.content
        assert 200 < int(response["Retry-After"]) <= 300
        assert views.CALLS == []
    finally:
        for reader in readers:
            await reader.arelease()


async def test_concurrent_async_request_gets_409(async_client: AsyncClient, key: str) -> None:
    first = asyncio.ensure_future(async_client.get(f"/views/async-slow/{key}/"))
    try:
        for _ in range(500):
            if views.ENTERED.is_set():
                break
            await asyncio.sleep(0.01)
        assert views.ENTERED.is_set()
        second = await AsyncClient().get(f"/views/async-slow/{key}/")
        assert second.status_code == 409
    finally:
        views.GATE.set()
    assert (await first).status_code == 200
    assert views.CALLS == ["aslow"]
    assert is_free(key)


async def test_async_lock_is_released_when_the_view_raises(
    async_client: AsyncClient, key: str
) -> None:
    with pytest.raises(views.Boom):
        await async_client.get(f"/views/async-boom/{key}/")
    assert views.CALLS == ["aboom"]
    assert is_free(key)


def test_async_store_outage_is_a_500_not_a_409(key: str) -> None:
    async def get(client: AsyncClient) -> Any:
        return await client.get(f"/views/astore/down/{key}/")

    # Settings change outside the event loop: closing the stores it resets is sync-only.
    with override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES}):
        with pytest.raises(LockStoreUnavailable):
            async_to_sync(get)(AsyncClient())
        response = async_to_sync(get)(AsyncClient(raise_request_exception=False))
    assert response.status_code == 500
    assert views.CALLS == []


# -- class-based views ----------------------------------------------------------------------
def test_mixin_runs_when_free_and_409_while_held(client: Client, key: str) -> None:
    assert client.post(f"/views/mixin/{key}/").status_code == 200
    assert is_free(f"mixin:{key}")
    holder = hold(f"mixin:{key}", ttl=9)
    try:
        response = client.post(f"/views/mixin/{key}/")
    finally:
        holder.release()
    assert response.status_code == 409
    assert response["Retry-After"] == "9"
    assert views.CALLS == ["mixin"]


def test_mixin_get_lock_key_and_lock_on_locked(client: Client, key: str) -> None:
    holder = hold(f"mixin-custom:{key}")
    try:
        response = client.get(f"/views/mixin-custom/{key}/")
    finally:
        holder.release()
    assert response.status_code == 503
    assert response.content.decode() == f"mixin busy mixin-custom:{key}"
    assert client.get(f"/views/mixin-custom/{key}/").status_code == 200
    assert views.CALLS == ["mixin_custom"]


def test_mixin_without_a_key_is_improperly_configured(rf: Any) -> None:
    from django.views import View

    from django_keel_lock import LockViewMixin

    class NoKey(LockViewMixin, View):
        def get(self, request: HttpRequest) -> HttpResponse:  # pragma: no cover
            return HttpResponse()

    with pytest.raises(ImproperlyConfigured, match="lock_key"):
        NoKey.as_view()(rf.get("/"))


async def test_async_mixin(async_client: AsyncClient, key: str) -> None:
    holder = hold(f"amixin:{key}")
    try:
        assert (await async_client.get(f"/views/async-mixin/{key}/")).status_code == 409
    finally:
        holder.release()
    assert (await async_client.get(f"/views/async-mixin/{key}/")).status_code == 200
    assert views.CALLS == ["amixin"]
    assert is_free(f"amixin:{key}")


def test_method_decorator_on_dispatch(client: Client, key: str) -> None:
    holder = hold(f"decorated:{key}")
    try:
        assert client.get(f"/views/decorated/{key}/").status_code == 409
    finally:
        holder.release()
    assert client.get(f"/views/decorated/{key}/").status_code == 200
    assert views.CALLS == ["decorated"]
    assert is_free(f"decorated:{key}")


async def test_method_decorator_on_dispatch_of_an_async_view(
    async_client: AsyncClient, key: str
) -> None:
    holder = hold(f"adecorated:{key}")
    try:
        assert (await async_client.get(f"/views/async-decorated/{key}/")).status_code == 409
    finally:
        holder.release()
    response = await async_client.get(f"/views/async-decorated/{key}/")
    assert response.status_code == 200
    assert json.loads(response.content)["ran"] == "adecorated"
    assert is_free(f"adecorated:{key}")


@pytest.mark.parametrize("prefix", ["store", "astore"])
def test_a_url_key_longer_than_the_store_takes_is_a_bad_request_not_a_server_error(
    prefix: str, key: str
) -> None:
    long = f"{key}-" + "a" * 300  # the database store takes keys of up to 255 characters
    response = Client(raise_request_exception=False).get(f"/views/{prefix}/sqlite/{long}/")
    assert response.status_code == 400
    assert views.CALLS == []


def test_a_url_key_with_control_characters_is_a_bad_request_not_a_lock(
    client: Client, key: str
) -> None:
    # ESC [ 2 J clears an operator's terminal, BEL rings it (a newline never matches <path>).
    response = client.get(f"/views/slow/{key}%1b%5b2J%07/")
    assert response.status_code == 400
    assert "slow" not in views.CALLS
    assert not list(get_lock_store("memory").iter_locks(key))


# -- several keys at once: @lock_view([...]) ---------------------------------------------------
@pytest.mark.parametrize(
    ("url", "prefix"),
    [("/views/transfer", "account"), ("/views/mixin-transfer", "maccount")],
    ids=["lock_view", "mixin"],
)
def test_a_list_of_templates_locks_every_key_of_the_request(
    client: Client, url: str, prefix: str
) -> None:
    source, target = random.randrange(10**9), random.randrange(10**9)
    held = hold(f"{prefix}:{target}")
    try:
        response = client.get(f"{url}/{source}/{target}/", headers=JSON)
    finally:
        held.release()
    assert response.status_code == 409
    assert response.json()["key"] == "+".join(sorted([f"{prefix}:{source}",
                                                       f"{prefix}:{target}"]))  # fmt: skip
    assert is_free(f"{prefix}:{source}")  # all or nothing: the free one was not kept
    response = client.get(f"{url}/{source}/{target}/")
    assert response.status_code == 200
    assert response.json()["keys"] == "+".join(sorted([f"{prefix}:{source}",
                                                       f"{prefix}:{target}"]))  # fmt: skip
    assert is_free(f"{prefix}:{source}") and is_free(f"{prefix}:{target}")


def test_a_view_reads_a_fence_per_key(client: Client) -> None:
    source, target = random.randrange(10**9), random.randrange(10**9)
    listed = client.get(f"/views/transfer/{source}/{target}/").json()["fences"]
    fences = dict(each.split("=") for each in listed.split(","))
    assert set(fences) == {f"account:{source}", f"account:{target}"}
    assert all(int(fence) > 0 for fence in fences.values())


async def test_an_async_view_with_a_list_of_templates(async_client: AsyncClient) -> None:
    source, target = random.randrange(10**9), random.randrange(10**9)
    held = await sync_to_async(hold)(f"aaccount:{source}")
    response = await async_client.get(f"/views/async-transfer/{source}/{target}/")
    assert response.status_code == 409
    await held.arelease()
    response = await async_client.get(f"/views/async-transfer/{source}/{target}/")
    assert response.status_code == 200 and views.CALLS == ["atransfer"]


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ([], ValueError, "lock key must name at least one key template"),
        (["a:<pk>", 3], TypeError, r"lock key\[1\]: must be a str template"),
        (["a:<pk>", "b<"], ImproperlyConfigured, "placeholder"),
    ],
)
def test_a_bad_list_of_view_templates_fails_at_decoration(
    key: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        lock_view(key)
