"""Views for tests/test_idempotency.py: one set per store alias, under /<alias>/..."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.views import View
from rest_framework.response import Response
from rest_framework.views import APIView

from django_keel_lock import idempotent
from django_keel_lock.idempotency.drf import IdempotentMixin

STORES = ["memory", "sqlite", "postgres", "mariadb", "redis"]
#: How many times each view ran, by the request's idempotency key (or "-").
CALLS: Counter[str] = Counter()
#: A view asked to ({"gate": true}) waits for this before it answers (at most 10 s).
GATE = threading.Event()
_mutex = threading.Lock()


def _count(request: HttpRequest) -> int:
    key = request.headers.get("Idempotency-Key", "-")
    with _mutex:
        CALLS[key] += 1
        return CALLS[key]


def pay(request: HttpRequest) -> HttpResponse:
    """Answers as the JSON body asks: {"sleep": s, "first_sleep": s, "gate": true (wait for
    GATE), "status": n, "raise": true, "size": n, "rollback": [aliases]}; each run's body is
    new (a uuid), so a replay is told from a rerun."""
    run = _count(request)
    asks: dict[str, Any] = json.loads(request.body or b"{}")
    time.sleep(asks.get("sleep", 0) + (asks.get("first_sleep", 0) if run == 1 else 0))
    if asks.get("gate"):
        GATE.wait(10)
    if asks.get("raise") and run == 1:
        raise RuntimeError("the view failed")
    if asks.get("rollback") and run == 1:
        for alias in asks["rollback"]:
            transaction.set_rollback(True, using=alias)
    status = asks.get("status", 201) if run == 1 else 201
    body = {"run": run, "id": uuid.uuid4().hex, "pad": "x" * asks.get("size", 0)}
    response = JsonResponse(body, status=status)
    response["Location"] = f"/payments/{body['id']}"
    response["Set-Cookie"] = "secret=1"
    response["X-Internal"] = "not kept"
    return response


def upload(request: HttpRequest) -> HttpResponse:
    """A multipart form with a file: answers what it read of both (after the key's check)."""
    run = _count(request)
    upload = request.FILES["file"]
    digest = hashlib.sha256(upload.read()).hexdigest()
    body = {"run": run, "id": uuid.uuid4().hex, "note": request.POST["note"], "sha256": digest}
    return JsonResponse(body, status=201)


def tenant(request: HttpRequest) -> str:
    """A scope that reads the database first, as a tenant lookup would (the database alias
    from the X-Database header): a transaction's first read, before the key is checked."""
    database = request.headers.get("X-Database", "default")
    get_user_model().objects.using(database).filter(pk=-1).exists()
    return "tenant-1"


def hook(request: HttpRequest, **kwargs: Any) -> HttpResponse:
    event = json.loads(request.body)
    with _mutex:
        CALLS[f"hook:{event['id']}"] += 1
    return HttpResponse(f"handled {event['id']} {uuid.uuid4().hex}")


def stream(request: HttpRequest) -> StreamingHttpResponse:
    _count(request)
    if json.loads(request.body or b"{}").get("gate"):
        GATE.wait(10)
    return StreamingHttpResponse(iter([b"a", b"b"]))


async def apay(request: HttpRequest) -> HttpResponse:
    return await sync_to_async(pay)(request)


class PayView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return pay(request)


class AsyncPayView(View):
    async def post(self, request: HttpRequest) -> HttpResponse:
        return await apay(request)


class DrfPay(IdempotentMixin, APIView):
    idempotency_required = True
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []
    idempotency_scope = "global"

    def post(self, request: Any) -> Response:
        run = _count(request)
        return Response({"run": run, "id": uuid.uuid4().hex, "data": request.data}, status=201)


class DrfHook(IdempotentMixin, APIView):
    """A webhook on DRF: its key from the JSON body."""

    idempotency_key = "drf:{id}"
    idempotency_scope = "global"
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    def post(self, request: Any) -> Response:
        with _mutex:
            CALLS[f"drf-hook:{request.data['id']}"] += 1
        return Response({"handled": request.data["id"], "run": uuid.uuid4().hex})


def plain(request: HttpRequest) -> HttpResponse:
    return pay(request)


def _views(alias: str) -> list[Any]:
    return [
        path(f"{alias}/pay/", idempotent(store=alias)(pay)),
        path(f"{alias}/pay-global/", idempotent(store=alias, scope="global")(pay)),
        path(f"{alias}/pay-wait/", idempotent(store=alias, scope="global", wait="10s")(pay)),
        path(
            f"{alias}/pay-wait-tenant/",
            idempotent(store=alias, scope=tenant, wait="10s")(pay),
        ),
        path(f"{alias}/upload/", idempotent(store=alias, scope="global")(upload)),
        path(f"{alias}/pay-short/", idempotent(store=alias, scope="global", ttl="1s")(pay)),
        path(
            f"{alias}/pay-lost/",
            idempotent(store=alias, scope="global", lock_ttl="0.3s")(pay),
        ),
        path(f"{alias}/pay-small/", idempotent(store=alias, scope="global", max_body=100)(pay)),
        path(f"{alias}/pay-required/", idempotent(store=alias, required=True)(pay)),
        path(
            f"{alias}/hooks/<str:provider>/",
            idempotent("{provider}:{id}", store=alias, scope="global")(hook),
        ),
        path(f"{alias}/stream/", idempotent(store=alias, scope="global")(stream)),
        path(f"{alias}/class/", idempotent(store=alias, scope="global")(PayView).as_view()),
        path(
            f"{alias}/drf/", type(f"Drf{alias}", (DrfPay,), {"idempotency_store": alias}).as_view()
        ),
        path(
            f"{alias}/drf-hook/",
            type(f"DrfHook{alias}", (DrfHook,), {"idempotency_store": alias}).as_view(),
        ),
        path(
            f"{alias}/async-class/",
            idempotent(store=alias, scope="global")(AsyncPayView).as_view(),
        ),
        path(f"{alias}/async/", idempotent(store=alias, scope="global")(apay)),
        path(
            f"{alias}/async-wait/",
            idempotent(store=alias, scope="global", wait="10s")(apay),
        ),
        path(f"{alias}/mw/pay/", plain),
        path(f"{alias}/free/pay/", plain),
    ]


urlpatterns = [
    path("admin/", admin.site.urls),
    *(pattern for alias in STORES for pattern in _views(alias)),
]
