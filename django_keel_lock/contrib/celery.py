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
import math
import types
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, Literal, ParamSpec, TypeVar, cast

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

from ..core import Lock, force_release, restore_lock
from ..durations import Duration, to_seconds
from ..exceptions import AlreadyQueued, InvalidLockToken, LockError, LockStoreUnavailable
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
from ..stores.base import LockInfo

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

#: Seconds before a retry when the holder's remaining time is unknown (it just released).
DEFAULT_RETRY_COUNTDOWN = 1.0
_ON_LOCKED: tuple[OnLocked, ...] = (SKIP, RAISE, RETRY)

_current: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_keel_lock_task_lock", default=None
)

# -- dedupe: what a duplicate send finds ------------------------------------------------------
#: Claim released when the task takes its run lock: one running and one queued at most.
QUEUED: Final = "queued"
#: Claim released when the task ends: one queued or running at most.
UNTIL_DONE: Final = "until_done"
Dedupe = Literal["queued", "until_done"]
#: What a duplicate `.delay()` does: return the existing task's AsyncResult, or raise.
RETURN: Final = "return"
OnDuplicate = Literal["return", "raise"]
#: The message header that carries a task's claim (a `Lock.serialize` token) to the worker.
CLAIM_HEADER = "keel_lock_claim"
#: The claim's key is the run lock's key and this: the two never meet in the store.
CLAIM_SUFFIX = ":claim"

# The claim the running task holds, which a retry of it hands on to its next message.
_claim: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_keel_lock_task_claim", default=None
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
    dedupe: Dedupe | None = None,
    on_duplicate: OnDuplicate = "return",
    dedupe_ttl: Duration | None = None,
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
    claim_ttl = _check_dedupe(dedupe, on_duplicate, dedupe_ttl)

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        wrapper = _wrap(fn, key, spec, on_locked, fixed_countdown, dedupe)
        if dedupe is None:
            return wrapper
        rules = _Dedupe(dedupe, on_duplicate, claim_ttl, key, fn, spec)
        return cast(Callable[P, R | None], _DedupedBody(wrapper, rules))

    return decorate


def _wrap(
    fn: Callable[P, R],
    key: KeyTemplate,
    spec: LockSpec,
    on_locked: OnLocked,
    countdown: float | None,
    dedupe: Dedupe | None = None,
) -> Callable[P, R | None]:
    """The task body `fn` run under a lock on `key` made from `spec` for each run; with
    `dedupe`, it also ends the claim its message brought (see `_Dedupe`)."""
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
        claim = _claim_of(task) if dedupe is not None else None

        def body() -> R:
            if claim is not None:
                if dedupe == QUEUED:
                    _give_back(claim)  # the work starts: the next send queues a new one
                else:
                    _extend_claim(claim, claim.ttl)  # its dedupe_ttl counts from the start
            token = _current.set(handle)
            try:
                return fn(*args, **kwargs)
            finally:
                _current.reset(token)

        claimed = _claim.set(claim)
        handed_on = False
        try:
            outcome = handle.run(body)
            if outcome.acquired:
                return outcome.value
            _refused(handle, task, on_locked, countdown)
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


# -- dedupe ---------------------------------------------------------------------------------
def _check_dedupe(
    dedupe: object, on_duplicate: object, dedupe_ttl: Duration | None
) -> float | None:
    """The claim's ttl in seconds (None: the task's ttl); a bad value raises naming it."""
    if dedupe not in (None, QUEUED, UNTIL_DONE):
        raise ValueError(f'dedupe must be None, "queued" or "until_done", got {dedupe!r}')
    if on_duplicate not in (RETURN, RAISE):
        raise ValueError(f'on_duplicate must be "return" or "raise", got {on_duplicate!r}')
    if dedupe is None and (on_duplicate != RETURN or dedupe_ttl is not None):
        raise ValueError(
            'on_duplicate= and dedupe_ttl= only apply with dedupe="queued" or "until_done"'
        )
    return None if dedupe_ttl is None else to_seconds("dedupe_ttl", dedupe_ttl)


@dataclasses.dataclass(frozen=True)
class _Dedupe:
    """How a task with `dedupe=` is sent: a claim per key, taken before the message goes."""

    mode: Dedupe
    on_duplicate: OnDuplicate
    ttl: float | None
    key: KeyTemplate
    fn: Callable[..., Any]
    spec: LockSpec

    def claim(self, key: str, task_name: str, task_id: str) -> Lock:
        """The handle on `key`'s claim for the task `task_id`; its holder names that task, so
        a duplicate can return its AsyncResult (`_claimant` reads it back)."""
        spec = dataclasses.replace(
            self.spec,
            ttl=self.spec.resolved_ttl() if self.ttl is None else self.ttl,
            timeout=0.0,
            holder=f"{task_name}[{task_id}]",
            auto_extend=False,
            max_hold=None,
        )
        return spec.lock(key + CLAIM_SUFFIX)

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
        claim = self.claim(key, task.name, task_id)
        existing = _take(claim, task.name)
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
        task_id = _claimant(existing.holder, task.name)
        state = "queued" if self.mode == QUEUED else "queued or running"
        if task_id is None or self.on_duplicate == RAISE:
            raise AlreadyQueued(
                key,
                task_id,
                f"{task.name}: a task with key {key!r} is already {state} "
                f"({task_id or existing.holder}); nothing was sent",
            )
        logger.info("not sending %s: %s[%s] with key %r is already %s", task.name, task.name,
                    task_id, key, state)  # fmt: skip
        return ClaimedResult(task_id, task, claim=(claim.key, claim.store_alias, existing.fence))


class ClaimedResult(AsyncResult):  # type: ignore[misc]
    """What `.delay()` of a task with `dedupe=` returns: an AsyncResult whose `revoke()` also
    frees the task's claim at once (a later send queues anew), not only when a worker
    discards the revoked message."""

    def __init__(
        self,
        task_id: str,
        task: Task,
        *,
        claim: tuple[str, str, int],
        parent: AsyncResult | None = None,
    ) -> None:
        super().__init__(
            task_id,
            backend=task.backend,
            task_name=task.name,
            app=task._get_app(),
            parent=parent,
        )
        self.claim_key, self.claim_store, self.claim_fence = claim

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


def _take(claim: Lock, task_name: str) -> LockInfo | None:
    """Take `claim`: None when taken, else the holder in the way (the newest, with several).
    LockStoreUnavailable when the store cannot be reached: never a silent drop."""
    for _ in range(5):
        if claim.acquire():
            return None
        holders = claim.holders()
        if holders:
            return holders[-1]
        # Released between the two calls: try again.
    raise LockStoreUnavailable(
        f"claim {claim.key!r} changed hands on every attempt; {task_name} was not sent"
    )


def _claimant(holder: str, task_name: str) -> str | None:
    """The task id in a claim's holder `<task name>[<task id>]`, None if it is not one."""
    prefix = f"{task_name}["
    if holder.startswith(prefix) and holder.endswith("]"):
        return holder[len(prefix) : -1] or None
    return None


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
    """Make `claim` live `seconds` more; False (logged) when it is gone or unreachable: the
    task goes on without it, and a duplicate may then be queued."""
    try:
        claim.extend(max(seconds, 0.001))
        return True
    except LockError as exc:
        logger.warning("claim %r not kept: %s", claim.key, exc)
        _give_back(claim)
        return False


def _give_back(claim: Lock) -> None:
    """Release `claim` if still held; a store outage only logs: it expires at its ttl."""
    try:
        claim.release()
    except LockStoreUnavailable as exc:
        logger.warning("claim %r not released (%s); it expires in %gs", claim.key, exc, claim.ttl)


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
