"""`run_once` and `@once`: a function run once per key; duplicates get its stored result.

    @once("webhook:stripe:{event_id}", ttl="24h")
    def handle_event(event_id, payload): ...

    ran, result = run_once(f"webhook:stripe:{event_id}", lambda: handle(payload))

The result must be JSON-serialisable: a duplicate gets it back as JSON reads it (a tuple
comes back a list).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction

from ..durations import Duration
from ..exceptions import LockStoreUnavailable
from ..options import LockSpec, check_key_fields, format_key, ttl_seconds
from ..stores.results import StoredResult
from .storage import after_commit, keep_releasing, result_store_for, take_kept

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("django_keel_lock")


def run_once(
    key: str,
    fn: Callable[[], Any],
    *,
    ttl: Duration = "24h",
    store: str = "default",
    wait: Duration = 0,
    lock_ttl: Duration | None = None,
) -> tuple[bool, Any]:
    """Call `fn()` unless a call under `key` already completed in the last `ttl`: `(True,
    its result)` when it ran, `(False, the stored result)` when it had run before.

    While another call of `key` runs, wait `wait` seconds for it, then raise LockUnavailable.
    `fn` raising keeps nothing (the next call runs it again). Inside a transaction, the
    result is kept once it commits. A result that cannot be kept (the store gone, the lock
    lost while `fn` ran) is still returned, with a WARNING: the next call runs `fn` again."""
    spec = LockSpec.parse("run_once", ttl=lock_ttl, timeout=wait, store=store, name="once")
    return _Once(ttl_seconds(ttl), spec).run(key, fn)


class _Once:
    def __init__(self, ttl: float, spec: LockSpec) -> None:
        self.ttl, self.spec = ttl, spec

    def run(self, key: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        handle = self.spec.lock(f"once:{key}")
        results = result_store_for(self.spec.store)
        if not handle.acquire():
            found = results.get(handle.key)
            if found is None:
                raise handle.unavailable("not run, another call of it is running: ")
            return False, json.loads(found.data)
        try:
            found = take_kept(handle, results)  # and released with it when there is one
            if found is not None:
                return False, json.loads(found.data)
            value = fn()
            data = _dumps(key, value)
        except BaseException:
            handle.release()
            raise
        owner, fence = handle.owner, handle.fence
        assert owner is not None and fence is not None
        kept = StoredResult(handle.key, "", fence, 0, data)

        def keep() -> None:
            # `fn` has run: a store gone now must not hide its result from the caller (a task
            # would be retried, and run again). Said in a WARNING instead.
            try:
                if not keep_releasing(handle, results, kept, self.ttl):
                    logger.warning("run_once %r: the lock was lost while it ran; not kept", key)
            except LockStoreUnavailable as exc:
                logger.warning("run_once %r: its result is not kept: %s", key, exc)
            try:  # when keeping it did not: the store failed (nothing if released)
                handle.release()
            except LockStoreUnavailable as exc:
                logger.warning("run_once %r: its lock frees itself within its ttl: %s", key, exc)

        if not after_commit(keep):
            handle.release()
        return True, value


def _dumps(key: str, value: Any) -> bytes:
    try:
        return json.dumps(value).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the result of the function run once under {key!r} must be JSON-serialisable "
            f"(it ran; nothing is kept, so the next call runs it again): {exc}"
        ) from None


def once(
    key: str | Callable[..., str],
    *,
    ttl: Duration = "24h",
    store: str = "default",
    wait: Duration = 0,
    lock_ttl: Duration | None = None,
) -> Callable[[F], F]:
    """Decorate a function so it runs once per key: `key` is a template over its arguments
    ("webhook:stripe:{event_id}") or a callable taking them. Returns the function's result on
    the first call and the stored result on every duplicate (see `run_once`)."""
    runner = _Once(
        ttl_seconds(ttl),
        LockSpec.parse("once", ttl=lock_ttl, timeout=wait, store=store, name="once"),
    )

    def decorate(fn: F) -> F:
        if iscoroutinefunction(fn):
            raise TypeError(f"once() takes a sync function; {fn.__qualname__} is async")
        check_key_fields(key, fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = format_key(key, fn, args, kwargs)
            return runner.run(name, lambda: fn(*args, **kwargs))[1]

        return cast(F, wrapper)

    return decorate
