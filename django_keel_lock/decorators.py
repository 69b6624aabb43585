"""`@locked`: run any function (sync or async) only while holding a lock named from its arguments.

    @locked("report:{date}", ttl="1h")                 # another caller gets LockUnavailable
    def build_report(date): ...

    @locked("sync:{account.pk}", on_locked="skip")      # another caller gets None (logged at INFO)
    async def sync_account(account): ...

The key comes from `core.format_key`, the one formatter every decorator shares.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, ParamSpec, Protocol, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction

from .core import (
    DEFAULT_RETRY_DELAY,
    KeyTemplate,
    Lock,
    check_options,
    default_holder,
    format_key,
)
from .core import lock as make_lock
from .durations import Duration
from .exceptions import LockUnavailable

logger = logging.getLogger("django_keel_lock")

P = ParamSpec("P")
R = TypeVar("R")

OnLocked = Literal["raise", "skip"]
ON_LOCKED_CHOICES: tuple[OnLocked, ...] = ("raise", "skip")


def labelled_holder(label: str) -> str:
    """`<hostname>:<pid> <label>`, cut to what a store keeps: tells people what holds a lock."""
    return f"{default_holder()} {label}".replace("\x00", "")[:255]


class _Skipping(Protocol):
    """What `locked(..., on_locked="skip")` returns: the result may be None (awaited, for
    async functions)."""

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]: ...


@overload
def locked(
    key: KeyTemplate,
    *,
    ttl: Duration | None = ...,
    timeout: Duration = ...,
    retry_delay: Duration = ...,
    store: str = ...,
    holder: str | None = ...,
    on_locked: Literal["raise"] = ...,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def locked(
    key: KeyTemplate,
    *,
    ttl: Duration | None = ...,
    timeout: Duration = ...,
    retry_delay: Duration = ...,
    store: str = ...,
    holder: str | None = ...,
    on_locked: Literal["skip"],
) -> _Skipping: ...


def locked(
    key: KeyTemplate,
    *,
    ttl: Duration | None = None,
    timeout: Duration = 0,
    retry_delay: Duration = DEFAULT_RETRY_DELAY,
    store: str = "default",
    holder: str | None = None,
    on_locked: OnLocked = "raise",
) -> Callable[[Callable[P, R]], Callable[P, Any]] | _Skipping:
    """Hold the lock `key` (a "{name}" template over the call's arguments, or a callable taking
    them) while the function runs; waits up to `timeout` seconds for it.

    When someone else holds it for the whole wait, `on_locked="raise"` raises LockUnavailable and
    `on_locked="skip"` returns None without calling the function (logged at INFO). A store that
    cannot be reached raises LockStoreUnavailable either way. Works on `async def` functions.
    """
    if on_locked not in ON_LOCKED_CHOICES:
        raise ValueError(f'on_locked must be "raise" or "skip", got {on_locked!r}')
    if not (isinstance(key, str) or callable(key)):
        raise TypeError(f"key must be a str template or a callable, got {type(key).__name__}")
    check_options(ttl=ttl, timeout=timeout, retry_delay=retry_delay, store=store)

    def decorate(fn: Callable[P, R]) -> Callable[P, Any]:
        name = f"{fn.__module__}.{fn.__qualname__}"

        def handle_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Lock:
            return make_lock(
                format_key(key, fn, args, kwargs),
                ttl=ttl,
                timeout=timeout,
                retry_delay=retry_delay,
                store=store,
                # Made per call: a forked worker names its own pid.
                holder=holder if holder is not None else labelled_holder(name),
            )

        def not_acquired(handle: Lock) -> None:
            if on_locked == "skip":
                logger.info("skipped %s: lock %r is held by someone else", name, handle.key)
                return None
            raise LockUnavailable(
                handle.key,
                f"{name} not run: lock {handle.key!r} is held by someone else "
                f"(waited {handle.timeout:g}s)",
            )

        if iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                handle = handle_for(args, kwargs)

                async def call() -> Any:
                    return await cast(Callable[..., Awaitable[Any]], fn)(*args, **kwargs)

                outcome = await handle.arun(call)
                return outcome.value if outcome.acquired else not_acquired(handle)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            handle = handle_for(args, kwargs)
            outcome = handle.run(lambda: fn(*args, **kwargs))
            return outcome.value if outcome.acquired else not_acquired(handle)

        return wrapper

    return decorate
