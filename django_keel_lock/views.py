"""`@lock_view` and `LockViewMixin`: one request at a time per key; the others get 409 Conflict.

    @lock_view("invoice:<pk>", ttl="2m")            # <name> is filled from the URL kwargs
    def charge_invoice(request, pk): ...

    class ChargeView(LockViewMixin, View):
        lock_key = "invoice:<pk>"

The view finds its handle as `request.keel_lock` (pass `request.keel_lock.fence` to what it
protects). A thin adapter over `core.Lock`: the lock is held while the view runs and released
when it returns (a streaming response's body is produced after that, outside the lock). A store that
cannot be reached raises LockStoreUnavailable (a 500): an outage is not contention.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, cast

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest, ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse

from .core import Lock
from .keyed import check_each, handle_for, name_templates
from .options import (
    OPTION_DEFAULTS,
    OPTION_NAMES,
    InvalidKey,
    LockOptions,
    LockSpec,
)

if TYPE_CHECKING:
    from django.views import View

    _MixinBase = View
else:
    _MixinBase = object

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])
#: A template ("invoice:<pk>") or a callable `(request, *args, **kwargs) -> key`; a list or
#: tuple of them (or a callable returning a list of keys) takes each key at once.
ViewKey = str | Callable[..., str | list[str]] | list[str] | tuple[str, ...]
OnLockedView = Callable[[HttpRequest, str], HttpResponseBase | Awaitable[HttpResponseBase]]

_PLACEHOLDER = re.compile(r"<([^<>]*)>")
_Part = tuple[bool, str]  # (is_placeholder, literal text or URL kwarg name)


@functools.lru_cache(maxsize=256)
def parse_key_template(template: str) -> tuple[_Part, ...]:
    """Split "invoice:<pk>" into literal text and URL kwarg names; a bad template raises."""
    parts: list[_Part] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(template):
        parts.append((False, template[pos : match.start()]))
        name = match.group(1)
        if not name.isidentifier():
            raise ImproperlyConfigured(
                f"lock key {template!r}: <{name}> is not a placeholder; write <name> where name "
                f"is a URL kwarg (< and > are only for placeholders)"
            )
        parts.append((True, name))
        pos = match.end()
    rest = template[pos:]
    if "<" in rest or ">" in rest or any("<" in t or ">" in t for p, t in parts if not p):
        raise ImproperlyConfigured(
            f"lock key {template!r} has an unpaired < or >; they are only for <name> placeholders"
        )
    parts.append((False, rest))
    return tuple(part for part in parts if part[0] or part[1])


def render_key_template(template: str, url_kwargs: dict[str, Any]) -> str:
    """The key for one request: each <name> replaced by str(url_kwargs[name]), as given."""
    out = []
    for is_name, text in parse_key_template(template):
        if not is_name:
            out.append(text)
        elif text in url_kwargs:
            out.append(str(url_kwargs[text]))
        else:
            known = ", ".join(sorted(url_kwargs)) or "none"
            raise ImproperlyConfigured(
                f"lock key {template!r} names <{text}>, which is not a URL kwarg of this view "
                f"(its URL kwargs: {known})"
            )
    return "".join(out)


def render_key(
    key: ViewKey, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | list[str]:
    """The key (or keys, for a list of templates) `key` names for one request."""
    if isinstance(key, str):
        return render_key_template(key, kwargs)
    if isinstance(key, list | tuple):
        return [render_key_template(template, kwargs) for template in key]
    return key(request, *args, **kwargs)


def check_view_key(key: object) -> None:
    """Raise unless `key` is a view's key: a template, a non-empty list or tuple of templates
    (several keys at once), or a callable."""
    if isinstance(key, str | list | tuple):
        check_each(key, _check_view_template, name="lock key")
    elif not callable(key):
        raise TypeError(
            f"lock key must be a str template, a list of them or a callable (request, *args, "
            f"**kwargs) -> str, got {type(key).__name__}"
        )


def _check_view_template(template: object) -> None:
    if not isinstance(template, str):
        raise TypeError(
            f"must be a str template such as 'account:<pk>', got {type(template).__name__}"
        )
    parse_key_template(template)


def request_label(request: HttpRequest) -> str:
    """What a view's holder says about the request: its method and URL *pattern*
    ("POST invoices/<int:pk>/charge/"). Not the path: paths carry secrets (password reset
    tokens, signed links) and whatever a client typed; never the query string."""
    match = getattr(request, "resolver_match", None)
    route = getattr(match, "route", None) or getattr(match, "view_name", None) or "?"
    return f"{request.method} {route}"


def wants_json(request: HttpRequest) -> bool:
    """True when the Accept header names JSON (application/json or */*+json) with q > 0.

    A bare */* (browsers, curl, the test client) gets text: JSON only for clients that ask.
    """
    for item in request.headers.get("Accept", "").split(","):
        media, *params = (piece.strip() for piece in item.split(";"))
        media = media.lower()
        if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")
        ):
            continue
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


def conflict_response(
    request: HttpRequest, key: str, retry_after: float | None, limit: int | None = None
) -> HttpResponse:
    """The default answer while `key` is held (with `limit`: while all its permits are
    taken): 409 with Retry-After, JSON if the client asks."""
    seconds = 0 if retry_after is None else max(0, math.ceil(retry_after))
    if limit is None:
        detail = "Another request holds this resource's lock; retry later."
        text = f"{key} is locked by another request"
    else:
        detail = f"All {limit} permits of this resource are taken; retry later."
        text = f"all {limit} permits of {key} are taken by other requests"
    response: HttpResponse
    if wants_json(request):
        response = JsonResponse({"detail": detail, "key": key}, status=409)
    else:
        response = HttpResponse(
            f"409 Conflict: {text}; retry in {seconds}s.\n",
            status=409,
            content_type="text/plain; charset=utf-8",
        )
    response["Retry-After"] = str(seconds)
    return response


@dataclass(frozen=True)
class ViewLock:
    """How one view takes its lock, checked (`_view_lock` builds it); shared by `lock_view`
    and `LockViewMixin`.

    `on_locked` is the views' form of the option every surface has (see `options`): a view
    answers a request, so instead of a marker it takes a callable `(request, key) -> response`
    that answers in place of the default 409 (None).
    """

    key: ViewKey
    spec: LockSpec
    on_locked: OnLockedView | None = None

    def handle(self, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Lock:
        key = render_key(self.key, request, args, kwargs)
        try:
            return handle_for(self.spec, key, label=request_label(request), raises=False)
        except InvalidKey as exc:
            # The key comes from the URL: one a lock cannot take (the store's length limit
            # too) is the client's mistake.
            raise BadRequest(f"cannot lock this resource: {exc}") from None

    def refused(self, request: HttpRequest, handle: Lock) -> HttpResponseBase:
        if self.on_locked is None:
            return conflict_response(
                request, handle.key, handle.remaining_time(), _limit_of(handle)
            )
        response = self.on_locked(request, handle.key)
        if inspect.isawaitable(response):
            raise ImproperlyConfigured(
                f"on_locked {self.on_locked!r} is async but the view is sync; make it sync"
            )
        return response

    async def arefused(self, request: HttpRequest, handle: Lock) -> HttpResponseBase:
        if self.on_locked is None:
            return conflict_response(
                request, handle.key, await handle.aremaining_time(), _limit_of(handle)
            )
        if iscoroutinefunction(self.on_locked):
            return await cast(Awaitable[HttpResponseBase], self.on_locked(request, handle.key))
        # User code (it may use the ORM): run it where Django runs sync code.
        response = await sync_to_async(self.on_locked)(request, handle.key)
        return await response if inspect.isawaitable(response) else response

    def call(self, view: Callable[..., Any], request: HttpRequest, args: Any, kwargs: Any) -> Any:
        """Run a view under the lock. Called inside a running event loop (an async view, or a
        sync `dispatch` of an async class-based view), it returns a coroutine instead."""
        if _in_event_loop():
            return self.acall(view, request, args, kwargs)
        handle = self.handle(request, args, kwargs)
        request.keel_lock = handle  # type: ignore[attr-defined]  # the view can read its fence
        outcome = handle.run(lambda: view(request, *args, **kwargs))
        return outcome.value if outcome.acquired else self.refused(request, handle)

    async def acall(
        self, view: Callable[..., Any], request: HttpRequest, args: Any, kwargs: Any
    ) -> Any:
        handle = self.handle(request, args, kwargs)
        request.keel_lock = handle  # type: ignore[attr-defined]  # the view can read its fence

        async def run_view() -> Any:
            result = view(request, *args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        outcome = await handle.arun(run_view)
        return outcome.value if outcome.acquired else await self.arefused(request, handle)


def _limit_of(handle: Lock) -> int | None:
    return handle.mode.limit if handle.mode.kind == "semaphore" else None


def _view_lock(
    surface: str, key: ViewKey, on_locked: OnLockedView | None, options: LockOptions
) -> ViewLock:
    """`ViewLock` from what `lock_view` and `LockViewMixin` take (`surface`, named in errors);
    a bad value raises naming it."""
    check_view_key(key)
    if on_locked is not None and not callable(on_locked):
        raise TypeError(
            f"on_locked must be a callable (request, key) -> HttpResponse, "
            f"got {type(on_locked).__name__}"
        )
    return ViewLock(key, LockSpec.parse(surface, **options), on_locked)


def _in_event_loop() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def lock_view(
    key: ViewKey, *, on_locked: OnLockedView | None = None, **options: Unpack[LockOptions]
) -> Callable[[ViewFunc], ViewFunc]:
    """Run the view only while holding `key`; while another request holds it, answer 409.

    `key` is a template whose <name> placeholders come from the URL kwargs, or a callable
    `(request, *args, **kwargs) -> key`. `on_locked(request, key)` answers instead of the 409.
    It takes every `LockOptions` (see there what each means; `name` defaults to the key
    template): `timeout` is how long to wait for the lock before answering; a lock lost while
    the view ran raises LockNotHeldError (a 500, and `ATOMIC_REQUESTS` rolls back) unless
    `on_lost` says otherwise. Works on sync and `async def` views and (via method_decorator on
    "dispatch") on class-based views.

    `auto_extend=True` keeps the lock alive while the view runs (the watchdog), for at most
    `max_hold` in all if given, as for `lock()`: ttl then only bounds how long a crashed
    worker blocks the key.

    `limit=N` lets N requests in at once (a semaphore: the 409's Retry-After is then the
    soonest permit's expiry), `shared=True` any number of shared ones while no exclusive one
    runs (an exclusive request they keep out gets the last one's expiry: it needs them all
    gone); the key is the same key `semaphore()` and `lock()` take.
    """
    name_templates(options, key)  # type: ignore[arg-type]
    config = _view_lock("lock_view", key, on_locked, options)

    def decorate(view: ViewFunc) -> ViewFunc:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                return await config.acall(view, request, args, kwargs)

            async_wrapper.lock_view_key = key  # type: ignore[attr-defined]
            return cast(ViewFunc, async_wrapper)

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return config.call(view, request, args, kwargs)

        # The system check E012 compares a template's <name>s with each URL's kwargs.
        wrapper.lock_view_key = key  # type: ignore[attr-defined]
        return cast(ViewFunc, wrapper)

    return decorate


class LockViewMixin(_MixinBase):
    """Class-based view twin of `lock_view`: set `lock_key` (or override `get_lock_key`).

    Each of the `LockOptions` is an attribute named `lock_<option>` that a subclass may set:
    lock_ttl, lock_timeout, lock_retry_delay, lock_store, lock_holder, lock_auto_extend,
    lock_max_hold, lock_on_lost ("raise", "warn", or a method `(self, lock)`), lock_name
    (default: `lock_key` when it is a template), lock_limit and lock_shared, with the same
    defaults and meanings as `@lock_view`'s (one declaration: `options.LockOptions`; an
    attribute a subclass leaves alone holds the option's default); define a method
    `lock_on_locked(self, request, key)` to answer instead of the 409.
    """

    lock_key: ViewKey | None = None
    #: A method `(self, request, key) -> HttpResponse` to answer instead of the default 409.
    lock_on_locked: OnLockedView | None = None

    def get_lock_key(self, request: HttpRequest, *args: Any, **kwargs: Any) -> str | list[str]:
        """The key for this request: `lock_key` with <name> filled from the URL kwargs (a
        list of templates: the keys, taken at once)."""
        template = self.lock_key
        if template is None:
            raise ImproperlyConfigured(
                f"{type(self).__name__} needs a lock_key (e.g. 'invoice:<pk>') or a "
                f"get_lock_key() method"
            )
        return render_key(template, request, args, kwargs)

    def _view_lock(self) -> ViewLock:
        options = cast(LockOptions, {name: getattr(self, f"lock_{name}") for name in OPTION_NAMES})
        name_templates(options, self.lock_key)  # type: ignore[arg-type]
        return _view_lock(type(self).__name__, self.get_lock_key, self.lock_on_locked, options)

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        config = self._view_lock()
        parent = super().dispatch
        if getattr(type(self), "view_is_async", False):
            return config.acall(parent, request, args, kwargs)
        return config.call(parent, request, args, kwargs)


for _option in OPTION_NAMES:
    setattr(LockViewMixin, f"lock_{_option}", OPTION_DEFAULTS[_option])

__all__ = ["LockViewMixin", "conflict_response", "lock_view"]
