"""`@idempotent`: a view whose retries get the first request's answer."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from ..durations import Duration
from ..waiting import to_the_end
from . import http
from .guard import DEFAULT_MAX_BODY, DEFAULT_METHODS, Attempt, Idempotency, Scope

Target = TypeVar("Target")


def idempotent(
    key: http.KeySource | None = None,
    *,
    ttl: Duration = "24h",
    header: str = "Idempotency-Key",
    required: bool = False,
    scope: Scope = "user",
    wait: Duration = 0,
    store: str = "default",
    methods: Collection[str] = DEFAULT_METHODS,
    statuses: Collection[int] | Callable[[int], bool] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    lock_ttl: Duration | None = None,
) -> Callable[[Target], Target]:
    """Run the view once per idempotency key; every retry with the key gets its response.

    The key is the `header` of the request (`key=None`), a template over the URL kwargs and
    the JSON or form body ("stripe:{id}", "{data.object.id}"), or a callable
    `(request, *args, **kwargs) -> str | None`; it is scoped by the signed-in user (or the
    session) unless `scope="global"` (webhooks) or a callable `(request) -> str`.

    The first request runs under the key's lock (for `lock_ttl`, default KEEL_LOCK_DEFAULT_TTL:
    longer than the view's longest run); a duplicate meanwhile waits `wait` seconds, then gets
    409 with Retry-After. Its response (status, body, `SAFE_HEADERS`) is kept `ttl` if its
    status is in `statuses` (default: 2xx and 4xx but 409 and 429) and its body at most
    `max_body` bytes; a retry gets it back with `Idempotent-Replayed: true`, or 422 if it is
    not the same request (method, path, body). A view that raises or answers 5xx keeps
    nothing: its key is free at once. Streaming and file responses are not kept.
    `required=True`: a request without a key gets 400. Only `methods` are guarded. While the
    store cannot be reached, a request gets 503 with Retry-After and the view does not run.

    Decorates a function view (sync or async) or a class-based view (its `dispatch`).
    """
    options = locals()  # every option as given: the defaults are declared here only
    del options["key"]
    config = Idempotency.parse(key, **options)

    def decorate(target: Target) -> Target:
        if isinstance(target, type):
            dispatch = target.dispatch  # type: ignore[attr-defined]
            # A View whose handlers are async: its dispatch returns their coroutine.
            is_async = bool(getattr(target, "view_is_async", False))
            target.dispatch = _method(config, dispatch, is_async)  # type: ignore[attr-defined]
            return target
        return cast(Target, guarded(config, cast(Callable[..., Any], target)))

    return decorate


def guarded(config: Idempotency, view: Callable[..., Any]) -> Callable[..., Any]:
    """`view` under `config`: the function `idempotent` returns for a function view."""
    if iscoroutinefunction(view):

        @functools.wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return await arun(config, request, args, kwargs, lambda: view(request, *args, **kwargs))

        return async_wrapper

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return run(config, request, args, kwargs, lambda: view(request, *args, **kwargs))

    return wrapper


def run(
    config: Idempotency,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: Callable[[], HttpResponseBase],
    reached: Callable[[], bool] | None = None,
) -> HttpResponseBase:
    """`call()` for `request` as `config` says: what the decorator and the middleware run.
    `reached()` False after the call: the answer did not come from the view (the middleware's
    CSRF refusal, a 404), so it is not kept and the key is free."""
    begun = config.begin(request, args, kwargs)
    if not isinstance(begun, Attempt):
        return begun if begun is not None else call()
    try:
        response = call()
    except BaseException:
        begun.abandon()
        raise
    if reached is not None and not reached():
        begun.abandon()
        return response
    return begun.finish(response)


async def arun(
    config: Idempotency,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: Callable[[], Awaitable[HttpResponseBase]],
) -> HttpResponseBase:
    """`run` for an async view: the store's calls in a thread, the view awaited.

    The thread goes on when the task is cancelled while it waits for the key: what it took
    is given back before the cancellation goes on (else the key stays locked for lock_ttl)."""
    started, cancelled = await to_the_end(sync_to_async(config.begin)(request, args, kwargs))
    begun = started.result()
    if cancelled is not None:
        if isinstance(begun, Attempt):
            await to_the_end(sync_to_async(begun.abandon)())
        raise cancelled
    if not isinstance(begun, Attempt):
        return begun if begun is not None else await call()
    try:
        response = await call()
    except BaseException:
        await sync_to_async(begun.abandon)()
        raise
    return await sync_to_async(begun.finish)(response)


def _method(
    config: Idempotency, dispatch: Callable[..., Any], is_async: bool
) -> Callable[..., Any]:
    if is_async:

        @functools.wraps(dispatch)
        async def async_dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            async def call() -> HttpResponseBase:
                answer = dispatch(self, request, *args, **kwargs)
                # A handler's coroutine; an HttpResponseNotAllowed comes wrapped in one too.
                return cast(
                    HttpResponseBase, await answer if inspect.isawaitable(answer) else answer
                )

            return await arun(config, request, args, kwargs, call)

        return async_dispatch

    @functools.wraps(dispatch)
    def guarded_dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return run(config, request, args, kwargs, lambda: dispatch(self, request, *args, **kwargs))

    return guarded_dispatch
