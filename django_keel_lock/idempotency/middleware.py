"""`IdempotencyMiddleware`: `@idempotent` for every view under some URL prefixes.

    KEEL_LOCK_IDEMPOTENT_PATHS = {"/api/": {"required": True}, "/hooks/": {...}}

Each prefix takes the options of `idempotent` (but a key template: the key comes from the
header, or a callable `key`); the longest matching prefix applies. Place it after
AuthenticationMiddleware, so that `scope="user"` sees the user, and after CsrfViewMiddleware.

A response is kept only when the request reached the view: the middleware's own
`process_view` marks it, and runs after those listed before it, so an answer given instead of
the view (CsrfViewMiddleware's 403, a 404 from the URL resolver) frees the key and is not kept.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

from .decorators import run
from .guard import Idempotency

SETTING = "KEEL_LOCK_IDEMPOTENT_PATHS"
_REACHED = "_keel_lock_idempotent_view"  # set on a request by process_view


class IdempotencyMiddleware:
    """Keeps and replays the answers of requests under the prefixes of
    KEEL_LOCK_IDEMPOTENT_PATHS (read when the middleware is made, at the first request)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        self.prefixes = _prefixes(getattr(settings, SETTING, None))

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        for prefix, config in self.prefixes:
            if request.path_info.startswith(prefix):
                return run(
                    config,
                    request,
                    (),
                    {},
                    lambda: self.get_response(request),
                    reached=lambda: getattr(request, _REACHED, False),
                )
        return self.get_response(request)

    def process_view(self, request: HttpRequest, *view: object) -> None:
        """Marks the request as about to reach its view (the middlewares' `process_view`
        before this one have let it through)."""
        setattr(request, _REACHED, True)


def _prefixes(value: object) -> list[tuple[str, Idempotency]]:
    if not isinstance(value, dict) or not value:
        raise ImproperlyConfigured(
            f"{SETTING} must be a dict of URL path prefixes to @idempotent options "
            f'({{"/api/": {{"required": True}}}}), got {value!r}'
        )
    found = []
    for prefix, options in value.items():
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise ImproperlyConfigured(f"{SETTING}: {prefix!r} is not a URL path prefix")
        if not isinstance(options, dict):
            raise ImproperlyConfigured(f"{SETTING}[{prefix!r}] must be a dict of options")
        if isinstance(options.get("key"), str):
            raise ImproperlyConfigured(
                f"{SETTING}[{prefix!r}]: a key template needs URL kwargs, which a middleware "
                f"does not have; use the header (no key) or a callable key"
            )
        try:
            found.append((prefix, Idempotency.parse(**options)))
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"{SETTING}[{prefix!r}]: {exc}") from None
    return sorted(found, key=lambda item: -len(item[0]))
