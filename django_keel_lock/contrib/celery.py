"""Celery tasks that must not run twice at once, without hand-written try/finally.

    from celery import shared_task
    from django_keel_lock.contrib.celery import locked_task

    @shared_task(bind=True, max_retries=10)
    @locked_task("report:{date}", ttl="1h", on_locked="retry")
    def build_report(self, date): ...

Celery is an optional extra (`django-keel-lock[celery]`): nothing else in the package imports
this module, so the app works without Celery installed.

A worker killed mid-task (SIGKILL, OOM) never releases its lock, but the lock still expires at
its ttl: the next run proceeds after that. Choose a ttl longer than the task ever runs (or use
`auto_extend=True`, the lock watchdog) and shorter than you are willing to wait after a crash.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

try:
    from celery import Task, current_task
    from celery.local import Proxy
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "django_keel_lock.contrib.celery needs Celery: pip install 'django-keel-lock[celery]'"
    ) from exc

from ..core import Lock
from ..durations import Duration, to_seconds
from ..options import (
    DEFAULT_RETRY_DELAY,
    RAISE,
    RETRY,
    SKIP,
    KeyTemplate,
    LockSpec,
    OnLocked,
    OnLost,
    check_on_locked,
    format_key,
    template_name,
)

__all__ = ["DEFAULT_RETRY_COUNTDOWN", "current_lock", "locked_task"]

logger = logging.getLogger("django_keel_lock.celery")

P = ParamSpec("P")
R = TypeVar("R")

#: Seconds before a retry when the holder's remaining time is unknown (it just released).
DEFAULT_RETRY_COUNTDOWN = 1.0
_ON_LOCKED: tuple[OnLocked, ...] = (SKIP, RAISE, RETRY)

_current: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_keel_lock_task_lock", default=None
)


def current_lock() -> Lock | None:
    """The lock the running `locked_task` holds (to pass its `fence` on), None outside one."""
    return _current.get()


def locked_task(
    key: KeyTemplate,
    *,
    ttl: Duration | None = None,
    on_locked: OnLocked = "skip",
    timeout: Duration = 0,
    retry_delay: Duration = DEFAULT_RETRY_DELAY,
    store: str = "default",
    holder: str | None = None,
    countdown: Duration | None = None,
    auto_extend: bool = False,
    max_hold: Duration | None = None,
    on_lost: OnLost = RAISE,
    limit: int | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the task body only while holding the lock `key` (formatted from the task's
    arguments, `self` included for bound tasks); put it *under* `@shared_task`.

    When the lock stays held for `timeout` seconds (default 0: don't wait), `on_locked` (the
    markers of `options`) decides: "skip" (SKIP) returns None and logs at INFO; "raise" (RAISE)
    raises `LockUnavailable`; "retry" (RETRY) calls the task's `retry()` after `countdown`
    seconds (default: the holder's remaining time, rounded up) and raises `LockUnavailable`
    once the task's `max_retries` are used up. A store that cannot be reached raises
    `LockStoreUnavailable` whatever `on_locked` says.

    `auto_extend=True` keeps the lock alive while the task runs (the lock watchdog), for at
    most `max_hold` in all if given; ttl then only bounds how long a crashed worker blocks.
    A lock lost while the task ran fails the task with LockNotHeldError unless `on_lost`
    ("raise", "warn" or a callable `(lock) -> None`, as for `lock()`) says otherwise.

    `limit=N` lets at most N runs of the key at once across all workers (a semaphore); the
    others are skipped, raised or retried as `on_locked` says.
    """
    check_on_locked(on_locked, _ON_LOCKED)
    # Fail where the task is defined, not in the worker on its first run.
    spec = LockSpec.parse(
        ttl=ttl,
        timeout=timeout,
        retry_delay=retry_delay,
        store=store,
        holder=holder,
        auto_extend=auto_extend,
        max_hold=max_hold,
        on_lost=on_lost,
        limit=limit,
        name=template_name(key),
    )
    if countdown is not None and on_locked != RETRY:
        raise ValueError('countdown= only applies to on_locked="retry"')
    fixed_countdown = (
        None if countdown is None else to_seconds("countdown", countdown, allow_zero=True)
    )

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        return _wrap(fn, key, spec, on_locked, fixed_countdown)

    return decorate


def _wrap(
    fn: Callable[P, R],
    key: KeyTemplate,
    spec: LockSpec,
    on_locked: OnLocked,
    countdown: float | None,
) -> Callable[P, R | None]:
    """The task body `fn` run under a lock on `key` made from `spec` for each run."""
    # Above the task decorator, the lock would wrap the task object in a plain function:
    # workers would run the registered task without the lock, and the name would lose
    # .delay(). The type, not isinstance(): isinstance() on shared_task's Proxy would
    # evaluate it (make the task) here, at import time.
    if issubclass(type(fn), (Task, Proxy)):
        raise TypeError(
            "locked_task must be applied below @shared_task/@app.task, not above: put "
            "@locked_task(...) on the line after @shared_task(...) or @app.task(...)"
        )

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        task = _running_task(args)
        handle = spec.lock(
            format_key(key, fn, args, kwargs),
            label=_task_label(task),
            raises=on_locked == RAISE or task is None,
        )

        def body() -> R:
            token = _current.set(handle)
            try:
                return fn(*args, **kwargs)
            finally:
                _current.reset(token)

        outcome = handle.run(body)
        if outcome.acquired:
            return outcome.value
        _refused(handle, task, on_locked, countdown)
        return None

    # Celery checks call arguments against the signature it reads here (no __wrapped__).
    wrapper.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return wrapper


def _running_task(args: tuple[Any, ...]) -> Task | None:
    """The bound task (`self`), else the task Celery is running in this thread, if any."""
    if args and isinstance(args[0], Task):
        return args[0]
    task = current_task._get_current_object() if current_task else None
    return task if isinstance(task, Task) else None


def _task_label(task: Task | None) -> str | None:
    """`<task name>[<task id>]` for the holder, so `locks list` says which run holds a key."""
    if task is None:
        return None
    return f"{task.name}[{getattr(task.request, 'id', None) or '?'}]"


def _refused(handle: Lock, task: Task | None, on_locked: OnLocked, countdown: float | None) -> None:
    name = task.name if task is not None else "task"
    task_id = getattr(task.request, "id", None) if task is not None else None
    if on_locked == SKIP:
        info = handle.info()
        logger.info(
            "skipped %s[%s]: %s is held by %s",
            name,
            task_id,
            handle.describe(),
            f"{info.holder} (fence {info.fence}, {info.expires_in:.1f}s left)" if info else "?",
        )
        return None
    error = handle.unavailable(f"{name}: ")
    if on_locked == RAISE or task is None:
        raise error
    if countdown is None:
        remaining = handle.remaining_time()
        countdown = max(1.0, float(math.ceil(remaining))) if remaining else DEFAULT_RETRY_COUNTDOWN
    retries, limit = getattr(task.request, "retries", 0) or 0, task.max_retries
    if limit is not None and retries >= limit:
        logger.info(
            "giving up on %s[%s] after %s retries: lock %r is held",
            name,
            task_id,
            retries,
            handle.key,
        )
    else:
        logger.info(
            "retrying %s[%s] in %gs: lock %r is held (retry %s of %s)",
            name,
            task_id,
            countdown,
            handle.key,
            retries + 1,
            limit if limit is not None else "unlimited",
        )
    # exc= is what Celery raises once max_retries are used up: the lock, not a bare
    # MaxRetriesExceededError, is what went wrong.
    raise task.retry(countdown=countdown, exc=error)
