"""What every idempotent surface does with a request: one `Idempotency`, checked once.

`Idempotency.begin(request)` either answers at once (a replay, 400, 409, 422, 503) or returns an
`Attempt` that holds the key's lock while the view runs; `Attempt.finish(response)` keeps
the response (fenced) and frees the key, `Attempt.abandon()` frees it after an exception.

Per request: acquire the key's lock (waiting `wait` seconds), read the key's result, and then
either replay it (the same fingerprint), refuse (another: 422), or run the view and keep what
it answered; a refused acquire reads the result too: a finished request is replayed, one still
running gets 409. The read releases the lock when it finds a result, and the write releases
it too (`storage.take_kept`, `storage.keep_releasing`): where the store fuses them (Redis,
PostgreSQL), a fresh request costs three round trips (the acquire, the read, the write), one
more than `lock_view`'s two, and a replay two.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack

from django.http import HttpRequest, HttpResponse, HttpResponseBase

from ..core import Lock
from ..durations import Duration, to_seconds
from ..exceptions import LockStoreUnavailable
from ..options import InvalidKey, LockSpec, ttl_seconds
from ..stores.results import ResultStore, StoredResult
from ..views import request_label
from . import http
from .storage import after_commit, keep_releasing, result_store_for, take_kept

logger = logging.getLogger("django_keel_lock")

#: The methods an idempotency key applies to by default: those that change something.
DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: The largest body kept by default (1 MiB); a larger one is answered but not kept.
DEFAULT_MAX_BODY = 1024 * 1024
Scope = Literal["user", "global"] | Callable[[HttpRequest], str]
#: Set on a request once it runs under a key: a guard inside (a decorated view under the
#: middleware's prefix) lets it through instead of taking the same key again (409).
_GUARDED = "_keel_lock_idempotent_attempt"


class IdempotentOptions(TypedDict, total=False):
    """What `idempotent` takes besides the key (see there what each means and its default);
    `IdempotencyMiddleware` takes them per URL prefix."""

    ttl: Duration
    header: str
    required: bool
    scope: Scope
    wait: Duration
    store: str
    methods: Collection[str]
    statuses: Collection[int] | Callable[[int], bool] | None
    max_body: int
    lock_ttl: Duration | None


def default_statuses(status: int) -> bool:
    """Kept by default: 2xx, and 4xx but 409 and 429 (the client may retry those)."""
    return 200 <= status < 300 or (400 <= status < 500 and status not in (409, 429))


@dataclass(frozen=True)
class Idempotency:
    """How one view (or URL prefix) keeps and replays its answers; `parse` checks it."""

    key: http.KeySource | None
    ttl: float
    header: str
    required: bool
    scope: Scope
    wait: float
    store: str
    methods: frozenset[str]
    statuses: Callable[[int], bool]
    max_body: int
    lock: LockSpec

    @classmethod
    def parse(
        cls, key: http.KeySource | None = None, **options: Unpack[IdempotentOptions]
    ) -> Idempotency:
        """The checked options (`idempotent`'s, which lists their defaults; those not given
        take them); a bad one raises naming it."""
        header = options.get("header", "Idempotency-Key")
        scope = options.get("scope", "user")
        max_body = options.get("max_body", DEFAULT_MAX_BODY)
        store = options.get("store", "default")
        if key is not None and not callable(key):
            if not isinstance(key, str):
                raise TypeError(
                    f"key must be None (the {header} header), a str template or a callable "
                    f"(request, *args, **kwargs) -> str, got {type(key).__name__}"
                )
            http.check_template(key)
        if not isinstance(header, str) or not header or not header.isascii():
            raise ValueError(f"header must be an HTTP header name, got {header!r}")
        if scope not in ("user", "global") and not callable(scope):
            raise ValueError(
                f'scope must be "user", "global" or a callable (request) -> str, got {scope!r}'
            )
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body must be an int >= 0 (bytes), got {max_body!r}")
        wait = to_seconds("wait", options.get("wait", 0), allow_zero=True)
        lock_ttl = options.get("lock_ttl")
        return cls(
            key=key,
            ttl=ttl_seconds(options.get("ttl", "24h")),
            header=header,
            required=bool(options.get("required", False)),
            scope=scope,
            wait=wait,
            store=store,
            methods=_methods(options.get("methods", DEFAULT_METHODS)),
            statuses=_statuses(options.get("statuses")),
            max_body=max_body,
            lock=LockSpec.parse(
                "idempotent", ttl=lock_ttl, timeout=wait, store=store, name="idempotent"
            ),
        )

    # -- one request -----------------------------------------------------------------------
    def begin(
        self, request: HttpRequest, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] = {}
    ) -> Attempt | HttpResponseBase | None:
        """An `Attempt` to run the view under, a response to answer at once, or None: this
        request has no key and needs none (the view runs as if not decorated)."""
        if request.method not in self.methods or getattr(request, _GUARDED, False):
            return None  # not guarded, or already by an outer guard (the middleware's)
        try:
            key = self._client_key(request, args, kwargs)
            if key is None:
                return None
            full = f"idempotent:{self._scope(request)}:{key}"
            handle = self.lock.lock(full, label=request_label(request))
        except (http.BadKey, InvalidKey) as exc:
            return http.problem(request, 400, f"Bad idempotency key: {exc}.")
        try:
            return self._enter(request, handle, http.fingerprint(request))
        except LockStoreUnavailable as exc:
            # Nothing ran and nothing can be told about the key: the client retries it later.
            logger.warning("idempotent %r: %s", handle.key, exc)
            response = http.problem(
                request, 503, "The idempotency key's store cannot be reached; retry."
            )
            response["Retry-After"] = "1"
            return response

    def _client_key(
        self, request: HttpRequest, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> str | None:
        if self.key is None:
            given = request.headers.get(self.header)
            if given is None:
                if self.required:
                    raise http.BadKey(f"this request needs an {self.header} header")
                return None
            return http.check_client_key(given, f"the {self.header} header")
        if callable(self.key):
            made = self.key(request, *args, **kwargs)
            if made is None and not self.required:
                return None
            return http.check_client_key(made or "", "the idempotency key")
        return http.check_client_key(
            http.render_template(self.key, request, kwargs), "the idempotency key"
        )

    def _scope(self, request: HttpRequest) -> str:
        if self.scope == "global":
            return "global"
        if callable(self.scope):
            return f"scope:{_part(http.check_client_key(self.scope(request), 'the scope'))}"
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return f"user:{_part(str(user.pk))}"
        session = getattr(request, "session", None)
        if session is not None and session.session_key:
            # The session key is a credential: keys and listings carry a digest of it.
            digest = hashlib.sha256(session.session_key.encode()).hexdigest()[:24]
            return f"session:{digest}"
        raise http.BadKey(
            'scope="user" keys a request by its user or session, and this one has neither; '
            'sign in, or use scope="global" for requests that name their own keys'
        )

    def _enter(
        self, request: HttpRequest, handle: Lock, fingerprint: str
    ) -> Attempt | HttpResponseBase:
        results = result_store_for(self.store)
        if not handle.acquire():
            found = results.get(handle.key)
            if found is None:
                response = http.problem(
                    request, 409, "A request with this idempotency key is still running; retry."
                )
                response["Retry-After"] = "1"
                return response
            return self._answer(request, found, fingerprint)
        try:
            found = take_kept(handle, results)  # and released with it when there is one
        except BaseException:
            handle.release()
            raise
        if found is not None:
            return self._answer(request, found, fingerprint)
        setattr(request, _GUARDED, True)
        return Attempt(self, handle, results, fingerprint)

    @staticmethod
    def _answer(request: HttpRequest, found: StoredResult, fingerprint: str) -> HttpResponse:
        if found.fingerprint != fingerprint:
            return http.problem(
                request,
                422,
                "This idempotency key was used with another request (method, path or body).",
            )
        return http.load_response(found.data)


class Attempt:
    """One request running under its key's lock."""

    def __init__(
        self, spec: Idempotency, handle: Lock, results: ResultStore, fingerprint: str
    ) -> None:
        self.spec, self.handle, self.results = spec, handle, results
        self.fingerprint = fingerprint

    def finish(self, response: HttpResponseBase) -> HttpResponseBase:
        """Keep `response` if it may be kept, free the key; `response` unchanged."""
        try:
            kept = self._keepable(response)
        except BaseException:
            self._release()
            raise
        if kept is None or not after_commit(lambda: self._keep(kept)):
            self._release()
        return response

    def abandon(self) -> None:
        """The view raised: nothing is kept and the key is free for a retry at once."""
        self._release()

    def _release(self) -> None:
        # The view has run: a store gone now must not turn its answer (or its exception)
        # into another one. The lock then frees itself at the end of its ttl.
        try:
            self.handle.release()
        except LockStoreUnavailable as exc:
            logger.warning(
                "idempotent %r: the key's lock is not released (free within its ttl): %s",
                self.handle.key,
                exc,
            )

    def _keepable(self, response: HttpResponseBase) -> StoredResult | None:
        key = self.handle.key
        if not isinstance(response, HttpResponse):  # streaming and file responses
            logger.debug("idempotent %r: a %s is not kept", key, type(response).__name__)
            return None
        if not self.spec.statuses(response.status_code):
            return None
        render = getattr(response, "render", None)
        if callable(render):
            render()  # a TemplateResponse (or DRF's Response): its bytes are what is kept
        size = len(response.content)
        if size > self.spec.max_body:
            logger.info(
                "idempotent %r: the response body is %d bytes, over max_body %d: not kept; "
                "a retry runs the view again",
                key,
                size,
                self.spec.max_body,
            )
            return None
        return StoredResult(
            key, self.fingerprint, 0, response.status_code, http.dump_response(response)
        )

    def _keep(self, result: StoredResult) -> None:
        handle = self.handle
        try:
            if not keep_releasing(handle, self.results, result, self.spec.ttl):
                logger.warning(
                    "idempotent %r: the lock was lost while the view ran (fence %s); its "
                    "response is not kept",
                    handle.key,
                    handle.fence,
                )
        except LockStoreUnavailable as exc:
            logger.warning("idempotent %r: response not kept: %s", handle.key, exc)
        finally:
            self._release()  # when keeping it did not: the store failed (nothing if released)


def _part(value: str) -> str:
    """`value` as one part of a key: without ":", so that the client's key after it (which
    may have some) cannot shift where the scope ends ("acme:1" + "x" is not "acme" + "1:x")."""
    return value.replace("%", "%25").replace(":", "%3A")


def _methods(methods: Collection[str]) -> frozenset[str]:
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f'methods must be a collection of method names ("POST"), got {methods!r}')
    return frozenset(m.upper() for m in methods)


def _statuses(statuses: Collection[int] | Callable[[int], bool] | None) -> Callable[[int], bool]:
    if statuses is None:
        return default_statuses
    if callable(statuses):
        return statuses
    kept = frozenset(statuses)
    if not all(isinstance(s, int) and 100 <= s < 600 for s in kept):
        raise ValueError(f"statuses must be HTTP status codes or a callable, got {statuses!r}")
    if any(s >= 500 for s in kept):
        raise ValueError("statuses must not keep a 5xx: a retry of a failure should run again")
    return kept.__contains__
