"""`@locked`: run any function (sync or async) only while holding a lock named from its arguments.

    @locked("report:{date}", ttl="1h")                 # another caller gets LockUnavailable
    def build_report(date): ...

    @locked("sync:{account.pk}", on_locked="skip")      # another caller gets None (logged at INFO)
    async def sync_account(account): ...

The key comes from `options.format_key`, which `locked_task` uses too, so both read key
templates alike; a list of templates is a lock of several keys (`keyed`):

    @locked(["account:{source}", "account:{target}"], ttl=30)
    def transfer(source, target, amount): ...
 `on_locked` takes the markers of `options`: RAISE (the default) or SKIP.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, ParamSpec, Protocol, TypeVar, Unpack, cast, overload

from asgiref.sync import iscoroutinefunction

from . import keyed
from .core import Lock
from .options import RAISE, SKIP, LockOptions, LockSpec, check_on_locked

logger = logging.getLogger("django_keel_lock")

P = ParamSpec("P")
R = TypeVar("R")

OnLocked = Literal["raise", "skip"]
ON_LOCKED_CHOICES: tuple[OnLocked, ...] = (RAISE, SKIP)


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
    key: keyed.KeyTemplates, *, on_locked: Literal["raise"] = ..., **options: Unpack[LockOptions]
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def locked(
    key: keyed.KeyTemplates, *, on_locked: Literal["skip"], **options: Unpack[LockOptions]
) -> _Skipping: ...


def locked(
    key: keyed.KeyTemplates, *, on_locked: OnLocked = "raise", **options: Unpack[LockOptions]
) -> Callable[[Callable[P, R]], Callable[P, Any]] | _Skipping:
    """Hold the lock `key` (a "{name}" template over the call's arguments, or a callable taking
    them; a list or tuple of them takes every key they name at once, all or nothing, as
    `lock([...])` does) while the function runs; waits up to `timeout` seconds for it. It
    takes every `LockOptions` (see there what each means); `name` defaults to the key
    template.

    When someone else holds it for the whole wait, `on_locked="raise"` (`options.RAISE`)
    raises LockUnavailable and `on_locked="skip"` (`options.SKIP`) returns None without calling
    the function (logged at INFO). A store that cannot be reached raises LockStoreUnavailable
    either way. A lock lost while the function runs raises LockNotHeldError when it returns
    (`on_lost`, as for `lock()`). Works on `async def` functions, not on generators.

    `auto_extend=True` keeps the lock alive while the function runs (the watchdog extends it
    every ttl/3), for at most `max_hold` in all if given, as for `lock()`: ttl then only
    bounds how long a crashed caller blocks the key.

    `limit=N` makes the key a semaphore (at most N calls at once), `shared=True` a shared
    lock (any number of shared calls, none while an exclusive one runs), as `semaphore()` and
    `lock(shared=True)`.
    """
    check_on_locked(on_locked, ON_LOCKED_CHOICES)
    keyed.check_templates(key)
    keyed.name_templates(options, key)
    spec = LockSpec.parse("locked", **options)

    def decorate(fn: Callable[P, R]) -> Callable[P, Any]:
        _check_wrappable(fn, key)
        return _wrap(fn, key, spec, on_locked)

    return decorate


def _check_wrappable(fn: Callable[..., Any], key: keyed.KeyTemplates) -> None:
    """Refuse, at decoration, a function `@locked` cannot hold a lock around, and a key
    template naming a parameter `fn` does not take (not on every call)."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        # The call only makes the generator: the lock would be released before its body
        # ran, and held by nobody while it yields.
        raise TypeError(
            f"@locked cannot wrap the generator function {fn.__qualname__}: its body runs "
            f"after the call returns, outside the lock. Take the lock inside it: "
            f"`with lock(...):` around the loop"
        )
    keyed.check_fields(key, fn)


def _wrap(
    fn: Callable[P, R], key: keyed.KeyTemplates, spec: LockSpec, on_locked: OnLocked
) -> Callable[P, Any]:
    """`fn` run under a lock on `key` made from `spec` for each call (sync or async)."""
    name = f"{fn.__module__}.{fn.__qualname__}"

    def handle_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Lock:
        # Made per call: a forked worker names its own pid in the holder.
        keys = keyed.format_keys(key, fn, args, kwargs)
        return keyed.handle_for(spec, keys, label=name, raises=on_locked == RAISE)

    def not_acquired(handle: Lock) -> None:
        if on_locked == SKIP:
            logger.info("skipped %s: %s", name, handle.unavailable())
            return None
        raise handle.unavailable(f"{name} not run: ")

    if iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            handle = handle_of(args, kwargs)

            async def call() -> Any:
                return await cast(Callable[..., Awaitable[Any]], fn)(*args, **kwargs)

            outcome = await handle.arun(call)
            return outcome.value if outcome.acquired else not_acquired(handle)

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
        handle = handle_of(args, kwargs)
        outcome = handle.run(lambda: fn(*args, **kwargs))
        return outcome.value if outcome.acquired else not_acquired(handle)

    return wrapper
