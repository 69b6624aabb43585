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

`dedupe=` also stops duplicates at the sender: `.delay()` takes a *claim*, a lock on the key
plus CLAIM_SUFFIX whose holder names the task id, and sends the serialized claim in the
message header CLAIM_HEADER; the worker releases it when the work starts ("queued") or ends
("until_done"). A duplicate finds the claim held and returns that task's AsyncResult.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import types
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar, Unpack, cast

try:
    from celery import Task, current_task
    from celery.exceptions import Retry
    from celery.local import Proxy
    from celery.result import AsyncResult, EagerResult
    from celery.signals import task_revoked
    from celery.utils import uuid
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "django_keel_lock.contrib.celery needs Celery: pip install 'django-keel-lock[celery]'"
    ) from exc

from .. import keyed
from ..core import Lock, force_release, restore_lock
from ..exceptions import AlreadyQueued, InvalidLockToken
from ..options import RAISE, SKIP, KeyTemplate, format_key
from ..stores.base import LockInfo
from .common import (
    CLAIM_SUFFIX,
    DEFAULT_RETRY_COUNTDOWN,
    QUEUED,
    TaskArgs,
    TaskOptions,
    call_holding,
    claim_holder,
    current_lock,
    log_skipped,
    take_claim,
)
from .common import extend_claim as _extend
from .common import give_back as _give

__all__ = [
    "CLAIM_HEADER",
    "CLAIM_SUFFIX",
    "DEFAULT_RETRY_COUNTDOWN",
    "AlreadyQueued",
    "ClaimedResult",
    "current_lock",
    "locked_task",
]

logger = logging.getLogger("django_keel_lock.celery")

P = ParamSpec("P")
R = TypeVar("R")

#: The message header that carries a task's claim (a `Lock.serialize` token) to the worker.
CLAIM_HEADER = "keel_lock_claim"

# The claim the running task holds, which a retry of it hands on to its next message.
_claim: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_keel_lock_task_claim", default=None
)


def locked_task(
    key: keyed.KeyTemplates, **options: Unpack[TaskArgs]
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the task body only while holding the lock `key` (formatted from the task's
    arguments, `self` included for bound tasks); put it *under* `@shared_task`.

    It takes every `LockOptions` (see there what each means; `name` defaults to the key
    template) and the options of its own below.

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

    `limit=N` lets at most N runs of the key at once across all workers (a semaphore),
    `shared=True` any number of shared runs while no exclusive one runs; the others are
    skipped, raised or retried as `on_locked` says.

    `dedupe=` stops duplicates before they are sent (needs `bind=True`). "queued": while a task
    with this key waits in the queue, `.delay()` / `.apply_async()` send nothing and return
    its AsyncResult; its claim ends when it takes the run lock (one running, one queued), is
    kept across `on_locked="retry"` retries and given up when skipped. "until_done": the claim
    ends when the task ends, so a duplicate of a running task returns it too. `on_duplicate=
    "raise"` raises `AlreadyQueued` instead. The claim expires after `dedupe_ttl` (default:
    `ttl`) from the send, from each retry and from the start of an "until_done" run; `revoke()`
    of the returned result frees it at once, of any other result when the worker discards the
    message. With `limit=N`, at most N are queued (or running) at once.
    """
    # Fail where the task is defined, not in the worker on its first run.
    parsed = TaskOptions.for_templates(key, options)

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        wrapper = _wrap(fn, key, parsed)
        # After _wrap refused a task object (its signature evaluates it).
        keyed.check_fields(key, fn)
        if parsed.dedupe is None:
            return wrapper
        single = cast(KeyTemplate, key)
        return cast(Callable[P, R | None], _DedupedBody(wrapper, _Dedupe(parsed, single, fn)))

    return decorate


def _wrap(
    fn: Callable[P, R], key: keyed.KeyTemplates, options: TaskOptions
) -> Callable[P, R | None]:
    """The task body `fn` run under a lock on `key` made as `options` say for each run; with
    `dedupe`, it also ends the claim its message brought (see `_Dedupe`)."""
    spec, dedupe = options.spec, options.dedupe
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
        handle = keyed.handle_for(
            spec,
            keyed.format_keys(key, fn, args, kwargs),
            label=_task_label(task),
            raises=options.on_locked == RAISE or task is None,
        )
        claim = _claim_of(task) if dedupe is not None else None

        def body() -> R:
            if claim is not None:
                if dedupe == QUEUED:
                    _give_back(claim)  # the work starts: the next send queues a new one
                else:
                    _extend_claim(claim, claim.ttl)  # its dedupe_ttl counts from the start
            return call_holding(handle, lambda: fn(*args, **kwargs))

        claimed = _claim.set(claim)
        handed_on = False
        try:
            outcome = handle.run(body)
            if outcome.acquired:
                return outcome.value
            _refused(handle, task, options)
            return None
        except Retry:
            handed_on = True  # the retry's message carries the claim (`_Dedupe.send`)
            raise
        finally:
            _claim.reset(claimed)
            if claim is not None and not handed_on:
                _give_back(claim)

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


def _refused(handle: Lock, task: Task | None, options: TaskOptions) -> None:
    name = task.name if task is not None else "task"
    task_id = getattr(task.request, "id", None) if task is not None else None
    if options.on_locked == SKIP:
        log_skipped(logger, f"{name}[{task_id}]", handle)
        return None
    error = handle.unavailable(f"{name}: ")
    if options.on_locked == RAISE or task is None:
        raise error
    countdown = options.countdown_for(handle)
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


# -- dedupe ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Dedupe:
    """How a task with `dedupe=` is sent: a claim per key, taken before the message goes."""

    options: TaskOptions
    key: KeyTemplate
    fn: Callable[..., Any]

    def send(
        self,
        task: Task,
        send: Callable[..., AsyncResult],
        args: Any,
        kwargs: Any,
        task_id: str | None,
        options: dict[str, Any],
    ) -> AsyncResult:
        """`task.apply_async(args, kwargs, task_id, **options)` unless a task with the same
        key holds the claim: then its AsyncResult (or AlreadyQueued), and nothing is sent."""
        headers = dict(options.pop("headers", None) or {})
        headers.pop(CLAIM_HEADER, None)  # a retry copies its request's headers
        if task_id is not None and task_id == getattr(task.request, "id", None):
            # A retry of the running task (on_locked="retry" or its own retry()): it stays
            # the queued one, with the claim it still holds, if any.
            held = _claim.get()
            if held is not None and _extend_claim(held, held.ttl + _delay_of(options)):
                headers[CLAIM_HEADER] = held.serialize()
            return send(args, kwargs, task_id=task_id, headers=headers, **options)
        task_id = task_id or uuid()
        key = format_key(self.key, self.fn, (task, *(args or ())), dict(kwargs or {}))
        claim = self.options.claim(key, claim_holder(task.name, task_id))
        existing = take_claim(claim, task.name)
        if existing is not None:
            return self._duplicate(task, key, claim, existing)
        headers[CLAIM_HEADER] = claim.serialize()
        try:
            sent = send(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException:
            _give_back(claim)  # not sent: nothing may wait for it
            raise
        if isinstance(sent, EagerResult):  # it ran already, and gave its claim back
            return sent
        assert claim.fence is not None
        return ClaimedResult(
            sent.id, task, claim=(claim.key, claim.store_alias, claim.fence), parent=sent.parent
        )

    def _duplicate(self, task: Task, key: str, claim: Lock, existing: LockInfo) -> AsyncResult:
        error = self.options.already_queued(task.name, key, existing)
        if error.task_id is None or self.options.on_duplicate == RAISE:
            raise error
        logger.info("not sending %s: %s", task.name, error)
        return ClaimedResult(
            error.task_id,
            task,
            claim=(claim.key, claim.store_alias, existing.fence),
            duplicate=True,
        )


class ClaimedResult(AsyncResult):  # type: ignore[misc]
    """What `.delay()` of a task with `dedupe=` returns: an AsyncResult whose `revoke()` also
    frees the task's claim at once (a later send queues anew), not only when a worker
    discards the revoked message. `duplicate` is True when nothing was sent: this is the task
    queued before."""

    def __init__(
        self,
        task_id: str,
        task: Task,
        *,
        claim: tuple[str, str, int],
        parent: AsyncResult | None = None,
        duplicate: bool = False,
    ) -> None:
        super().__init__(
            task_id,
            backend=task.backend,
            task_name=task.name,
            app=task._get_app(),
            parent=parent,
        )
        self.claim_key, self.claim_store, self.claim_fence = claim
        self.duplicate = duplicate

    def revoke(self, *args: Any, **kwargs: Any) -> None:
        super().revoke(*args, **kwargs)
        # Only that acquisition of the claim: one taken since by the next task stays.
        force_release(
            self.claim_key,
            store=self.claim_store,
            fence=self.claim_fence,
            user=f"revoke() of task {self.id}",
        )


class _DedupedBody:
    """The body of a task with `dedupe=`, as a descriptor: Celery makes each task class with
    `type(name, (Task,), {"run": body, ...})`, which calls `__set_name__`, where the class
    gets the `apply_async` that de-duplicates. (`locked_task` sits under `@shared_task`, so
    this is the one moment it meets the task class.) With `bind=False` Celery wraps the body
    in a staticmethod and no hook runs: the body then refuses to run."""

    def __init__(self, wrapper: Callable[..., Any], rules: _Dedupe) -> None:
        functools.update_wrapper(self, wrapper)
        self._wrapper = wrapper
        self._rules = rules
        self._hooked = False
        # Celery checks call arguments against a function it builds from `body.__call__`
        # when the body is not a function: the instance's, so the task's own signature.
        vars(self)["__call__"] = wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._hooked:
            raise TypeError(
                f"locked_task(dedupe=...) needs a bound task: use @shared_task(bind=True) or "
                f"@app.task(bind=True) over {self._rules.fn.__qualname__}"
            )
        return self._wrapper(*args, **kwargs)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __set_name__(self, owner: type, name: str) -> None:
        if name != "run" or not issubclass(owner, Task):
            return
        rules = self._rules
        cls: type[Task] = owner

        def apply_async(
            task: Task, args: Any = None, kwargs: Any = None, task_id: str | None = None,
            **options: Any,
        ) -> AsyncResult:  # fmt: skip
            parent = super(cls, task).apply_async  # type: ignore[misc]  # Celery is untyped
            return rules.send(task, parent, args, kwargs, task_id, options)

        owner.apply_async = apply_async  # type: ignore[attr-defined]
        self._hooked = True


def _claim_of(task: Task | None) -> Lock | None:
    """The claim the running task's message brought, if any."""
    token = _header(getattr(task, "request", None))
    if token is None:
        return None
    try:
        return restore_lock(token)
    except InvalidLockToken as exc:
        logger.warning("ignoring the claim of %s: %s", _task_label(task), exc)
        return None


def _header(request: object) -> str | None:
    headers = getattr(request, "headers", None) or {}
    token = headers.get(CLAIM_HEADER) or getattr(request, CLAIM_HEADER, None)
    return token if isinstance(token, str) else None


def _delay_of(options: dict[str, Any]) -> float:
    """Seconds until a message sent with `options` runs (its countdown or eta)."""
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        return max(0.0, float(countdown))
    if isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo or UTC)
        return max(0.0, (eta - now).total_seconds())
    return 0.0


def _extend_claim(claim: Lock, seconds: float) -> bool:
    return _extend(claim, seconds, logger)


def _give_back(claim: Lock) -> None:
    _give(claim, logger)


def _free_claim_of_revoked(request: object = None, **_: Any) -> None:
    """A worker discarded a revoked (or expired) message, or terminated its task: free the
    claim it carried, so the next send queues at once."""
    token = _header(request)
    if token is None:
        return
    try:
        _give_back(restore_lock(token))
    except InvalidLockToken as exc:
        logger.warning("revoked task with an unreadable claim: %s", exc)


task_revoked.connect(_free_claim_of_revoked, weak=False)
