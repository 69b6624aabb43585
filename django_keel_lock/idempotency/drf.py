"""`IdempotentMixin`: `@idempotent` for Django REST framework views.

    class PaymentView(IdempotentMixin, APIView):
        idempotency_required = True

        def post(self, request): ...

The key is read once DRF has authenticated the request (`initial`), so `scope="user"` is the
user of DRF's authentication (a token's user too); the response kept is the rendered one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from django.http import HttpResponseBase

from ..durations import Duration
from . import http
from .guard import DEFAULT_MAX_BODY, DEFAULT_METHODS, Attempt, Idempotency, Scope


class _Answered(Exception):
    """Raised from `initial` to answer without running the handler (a replay, 400, 409, 422)."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__(response.status_code)
        self.response = response


class IdempotentMixin:
    """Each option of `idempotent` is an attribute `idempotency_<option>`, with its default.
    Put it before APIView (or a generic view) in the bases: it extends their `dispatch`,
    `initial`, `handle_exception` and `finalize_response`."""

    idempotency_key: http.KeySource | None = None
    idempotency_ttl: Duration = "24h"
    idempotency_header: str = "Idempotency-Key"
    idempotency_required: bool = False
    idempotency_scope: Scope = "user"
    idempotency_wait: Duration = 0
    idempotency_store: str = "default"
    idempotency_methods: Collection[str] = DEFAULT_METHODS
    idempotency_statuses: Collection[int] | Callable[[int], bool] | None = None
    idempotency_max_body: int = DEFAULT_MAX_BODY
    idempotency_lock_ttl: Duration | None = None

    _idempotency_config: Idempotency | None = None
    _idempotency_attempt: Attempt | None = None

    @classmethod
    def idempotency(cls) -> Idempotency:
        """The checked options of this view class, made once per class."""
        config = cls.__dict__.get("_idempotency_config")
        if config is None:
            config = Idempotency.parse(
                cls.idempotency_key,
                ttl=cls.idempotency_ttl,
                header=cls.idempotency_header,
                required=cls.idempotency_required,
                scope=cls.idempotency_scope,
                wait=cls.idempotency_wait,
                store=cls.idempotency_store,
                methods=cls.idempotency_methods,
                statuses=cls.idempotency_statuses,
                max_body=cls.idempotency_max_body,
                lock_ttl=cls.idempotency_lock_ttl,
            )
            cls._idempotency_config = config
        return config

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._idempotency_attempt = None
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            attempt, self._idempotency_attempt = self._idempotency_attempt, None
            if attempt is not None:
                attempt.abandon()
            raise

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        begun = self.idempotency().begin(request, args, kwargs)
        if isinstance(begun, HttpResponseBase):
            raise _Answered(begun)
        self._idempotency_attempt = begun

    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, _Answered):
            return exc.response
        return super().handle_exception(exc)  # type: ignore[misc]

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        attempt, self._idempotency_attempt = self._idempotency_attempt, None
        return response if attempt is None else attempt.finish(response)
