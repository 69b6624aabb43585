"""Idempotent requests and functions: the first runs under its key's lock and its answer is
kept; every retry with the key gets that answer back (see docs/idempotency.md).

`idempotent` (views), `IdempotencyMiddleware` (URL prefixes), `drf.IdempotentMixin` (Django
REST framework), `once` and `run_once` (any code)."""

from __future__ import annotations

from .decorators import idempotent
from .guard import DEFAULT_MAX_BODY, DEFAULT_METHODS, Idempotency, default_statuses
from .http import MAX_KEY_LENGTH, REPLAYED_HEADER, SAFE_HEADERS
from .middleware import IdempotencyMiddleware
from .once import once, run_once

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_METHODS",
    "MAX_KEY_LENGTH",
    "REPLAYED_HEADER",
    "SAFE_HEADERS",
    "Idempotency",
    "IdempotencyMiddleware",
    "default_statuses",
    "idempotent",
    "once",
    "run_once",
]
