"""Views for the lock_view / LockViewMixin tests. Each records that it ran in `CALLS`."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_keel_lock import LockViewMixin, lock_view
from tests.support.holders import takeovers

CALLS: list[str] = []
# Set by a test to make `slow` / `aslow` wait inside the lock until released.
GATE = threading.Event()
ENTERED = threading.Event()


def _ran(name: str, **kwargs: Any) -> HttpResponse:
    CALLS.append(name)
    return JsonResponse({"ran": name, **{k: str(v) for k, v in kwargs.items()}})


@lock_view("invoice:<pk>", ttl="2m", store="memory")
def charge(request: HttpRequest, pk: int) -> HttpResponse:
    handle = request.keel_lock  # type: ignore[attr-defined]
    return _ran("charge", pk=pk, fence=handle.fence, held=handle.is_locked() and handle.held)


STORE_VIEWS: dict[str, Any] = {}


def store_view(request: HttpRequest, store: str, key: str) -> Any:
    """Dispatch to a lock_view-decorated view for `store`, built once per store alias."""
    view = STORE_VIEWS.get(store)
    if view is None:

        @lock_view("<key>", ttl=60, store=store)
        def view(request: HttpRequest, key: str) -> HttpResponse:
            return _ran("store_view", key=key)

        STORE_VIEWS[store] = view
    return view(request, key=key)


@lock_view(lambda request, key: f"callable:{key}", store="memory", ttl=60)
def by_callable(request: HttpRequest, key: str) -> HttpResponse:
    return _ran("by_callable", key=key)


def _busy(request: HttpRequest, key: str) -> HttpResponse:
    return HttpResponse(f"busy {key}", status=423)


@lock_view("<key>", store="memory", on_locked=_busy)
def custom(request: HttpRequest, key: str) -> HttpResponse:
    return _ran("custom", key=key)


@lock_view("<key>", store="memory", timeout=5, ttl=60)
def waits(request: HttpRequest, key: str) -> HttpResponse:
    return _ran("waits", key=key)


@lock_view("<nope>", store="memory")
def bad_placeholder(request: HttpRequest, key: str) -> HttpResponse:  # pragma: no cover
    return _ran("bad_placeholder")


@lock_view("<key>", store="memory", ttl=60)
def slow(request: HttpRequest, key: str) -> HttpResponse:
    ENTERED.set()
    GATE.wait(10)
    return _ran("slow", key=key)


@lock_view("<key>", store="memory", ttl=60)
async def aview(request: HttpRequest, key: str) -> HttpResponse:
    await asyncio.sleep(0)
    handle = request.keel_lock  # type: ignore[attr-defined]
    return _ran("aview", key=key, fence=handle.fence, held=handle.held)


async def _abusy(request: HttpRequest, key: str) -> HttpResponse:
    return HttpResponse(f"async busy {key}", status=423)


@lock_view("<key>", store="memory", ttl=60, on_locked=_abusy)
async def aview_custom(request: HttpRequest, key: str) -> HttpResponse:
    return _ran("aview_custom", key=key)


@lock_view("<key>", store="memory", ttl=60)
async def aslow(request: HttpRequest, key: str) -> HttpResponse:
    ENTERED.set()
    await asyncio.to_thread(GATE.wait, 10)
    return _ran("aslow", key=key)


#: What an `extending` view runs for, and its lock's ttl (the view outlives it three times).
EXTEND_RUN, EXTEND_TTL, EXTEND_MAX_HOLD = 1.5, 0.5, 1.0
EXTEND_OPTIONS: dict[str, dict[str, Any]] = {
    "auto-extend": {"auto_extend": True},
    "no-extend": {},
    "max-hold": {"auto_extend": True, "max_hold": EXTEND_MAX_HOLD},
}
#: The times (seconds in) at which another handle took an `extending` view's key.
TAKEN: list[float] = []
EXTEND_VIEWS: dict[tuple[str, str], Any] = {}


def extending(request: HttpRequest, options: str, store: str, key: str) -> Any:
    """A view locked on `key` in `store` with EXTEND_OPTIONS[options] that runs EXTEND_RUN
    seconds, trying to take its own key from another handle (it stops once it did)."""
    view = EXTEND_VIEWS.get((options, store))
    if view is None:

        @lock_view("<key>", ttl=EXTEND_TTL, store=store, **EXTEND_OPTIONS[options])
        def view(request: HttpRequest, key: str) -> HttpResponse:
            TAKEN.extend(takeovers(store, key, EXTEND_RUN, until_taken=True))
            return _ran("extending", key=key)

        EXTEND_VIEWS[options, store] = view
    return view(request, key=key)


ASTORE_VIEWS: dict[str, Any] = {}


async def astore_view(request: HttpRequest, store: str, key: str) -> Any:
    view = ASTORE_VIEWS.get(store)
    if view is None:

        @lock_view("<key>", ttl=60, store=store)
        async def view(request: HttpRequest, key: str) -> HttpResponse:
            return _ran("astore_view", key=key)

        ASTORE_VIEWS[store] = view
    return await view(request, key=key)


class MixinView(LockViewMixin, View):
    lock_key = "mixin:<key>"
    lock_store = "memory"
    lock_ttl = 60

    def post(self, request: HttpRequest, key: str) -> HttpResponse:
        return _ran("mixin", key=key)


class MixinExtendView(LockViewMixin, View):
    lock_key = "mixin-extend:<key>"
    lock_store = "memory"
    lock_auto_extend = True
    lock_max_hold = "5m"

    def get(self, request: HttpRequest, key: str) -> HttpResponse:
        handle = request.keel_lock  # type: ignore[attr-defined]
        return _ran("mixin_extend", auto_extend=handle.auto_extend, max_hold=handle.max_hold)


class MixinCustomView(LockViewMixin, View):
    lock_store = "memory"

    def get_lock_key(self, request: HttpRequest, *args: Any, **kwargs: Any) -> str:
        return f"mixin-custom:{kwargs['key']}"

    def lock_on_locked(self, request: HttpRequest, key: str) -> HttpResponse:
        return HttpResponse(f"mixin busy {key}", status=503)

    def get(self, request: HttpRequest, key: str) -> HttpResponse:
        return _ran("mixin_custom", key=key)


class AsyncMixinView(LockViewMixin, View):
    lock_key = "amixin:<key>"
    lock_store = "memory"

    async def get(self, request: HttpRequest, key: str) -> HttpResponse:
        await asyncio.sleep(0)
        return _ran("amixin", key=key)


@method_decorator(lock_view("decorated:<key>", store="memory"), name="dispatch")
class DecoratedView(View):
    def get(self, request: HttpRequest, key: str) -> HttpResponse:
        return _ran("decorated", key=key)


@method_decorator(lock_view("adecorated:<key>", store="memory"), name="dispatch")
class AsyncDecoratedView(View):
    async def get(self, request: HttpRequest, key: str) -> HttpResponse:
        await asyncio.sleep(0)
        return _ran("adecorated", key=key)


class Boom(Exception):
    pass


@lock_view("<key>", store="memory", ttl=60)
def boom(request: HttpRequest, key: str) -> HttpResponse:
    CALLS.append("boom")
    raise Boom(key)


@lock_view("<key>", store="memory", ttl=60)
async def aboom(request: HttpRequest, key: str) -> HttpResponse:
    CALLS.append("aboom")
    raise Boom(key)


# Several keys at once: a list of templates.
@lock_view(["account:<source>", "account:<target>"], store="memory", ttl=60)
def transfer(request: HttpRequest, source: int, target: int) -> HttpResponse:
    handle = request.keel_lock  # type: ignore[attr-defined]
    fences = {key: handle.fences[key] for key in handle.keys}
    return _ran("transfer", keys="+".join(handle.keys), fences=json_fences(fences))


@lock_view(["aaccount:<source>", "aaccount:<target>"], store="memory", ttl=60)
async def atransfer(request: HttpRequest, source: int, target: int) -> HttpResponse:
    await asyncio.sleep(0)
    return _ran("atransfer", keys="+".join(request.keel_lock.keys))  # type: ignore[attr-defined]


class MixinTransferView(LockViewMixin, View):
    lock_key = ("maccount:<source>", "maccount:<target>")
    lock_store = "memory"

    def get(self, request: HttpRequest, source: int, target: int) -> HttpResponse:
        return _ran("mixin_transfer", keys="+".join(request.keel_lock.keys))  # type: ignore[attr-defined]


def json_fences(fences: dict[str, int]) -> str:
    return ",".join(f"{key}={fence}" for key, fence in fences.items())
