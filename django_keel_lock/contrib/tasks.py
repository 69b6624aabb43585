"""Django Tasks (`django.tasks`) that must not run twice at once, or be queued twice.

    from django.tasks import task
    from django_keel_lock.contrib.tasks import locked_task

    @locked_task("report:{date}", ttl="1h", on_locked="retry")
    @task
    def build_report(date): ...

It works with `django.tasks` on Django 6 and with the `django-tasks` backport on Django 5.2
(the `[tasks]` extra); nothing else in the package imports this module.

`locked_task` goes *above* `@task`: `@task` turns the function into a `Task`, and
`locked_task` turns that into a `LockedTask` (a subclass, so every backend and worker takes
it) whose function runs under the lock and whose `enqueue()` de-duplicates.

`dedupe=` takes the same claim as the Celery version (contrib.common), but Django Tasks have
no message headers and the backend names a task's id only once it is enqueued. So `.enqueue()`
checks the claim, enqueues and takes the claim with the new id in its holder, all under a short
*gate* lock (the key plus GATE_SUFFIX) that makes those three one step; the worker finds its
claim by that holder (the id from the `TaskContext` every run of a `LockedTask` gets).

A worker can take the task between the enqueue and the claim. A run that does not find its
claim therefore looks again behind the gate, which the enqueue lets go only once it has
claimed; an enqueue whose gate expired meanwhile gives its claim back. Either way no claim is
left naming a task that ran without it (and that would refuse every enqueue until it expired).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar, Unpack, cast

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.utils import timezone

try:
    from django.tasks.base import Task, TaskContext, TaskResult
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # Django 5.2: the backport
    try:
        from django_tasks.base import (  # type: ignore[no-redef,assignment]
            Task,
            TaskContext,
            TaskResult,
        )
        from django_tasks.exceptions import (  # type: ignore[no-redef,assignment]
            TaskResultDoesNotExist,
        )
    except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
        raise ImportError(
            "django_keel_lock.contrib.tasks needs Django 6's django.tasks or, on Django 5.2, "
            "the django-tasks backport: pip install 'django-keel-lock[tasks]'"
        ) from exc

from .. import keyed, tokens
from ..core import Lock, lock, restore_lock
from ..exceptions import AlreadyQueued
from ..options import RAISE, RETRY, SKIP
from ..stores.base import LockInfo
from .common import (
    CLAIM_SUFFIX,
    TaskArgs,
    TaskOptions,
    call_holding,
    claim_holder,
    current_lock,
    extend_claim,
    give_back,
    log_skipped,
)

__all__ = [
    "CLAIM_SUFFIX",
    "GATE_SUFFIX",
    "RETRIES_KWARG",
    "AlreadyQueued",
    "LockedTask",
    "current_lock",
    "locked_task",
]

#: The keyword argument a retry's TaskResult carries: how many retries came before it. The
#: task's function never sees it.
RETRIES_KWARG = "keel_lock_retries"
#: The gate's key is the run lock's key and this: held only while `.enqueue()` checks the
#: claim, enqueues and claims.
GATE_SUFFIX = ":enqueue"
# Enqueueing is one insert: a gate outlives it by far, and waiting that long for one means
# its holder died (it then expires).
_GATE_TTL = 10.0
# The key whose gate this context holds while it enqueues: a backend that runs the task inside
# `.enqueue()` (the immediate one) must not wait for that gate.
_enqueuing: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "django_keel_lock_tasks_enqueuing", default=None
)

logger = logging.getLogger("django_keel_lock.tasks")
P = ParamSpec("P")
R = TypeVar("R")


def locked_task(
    key: keyed.KeyTemplates, *, max_retries: int | None = 3, **options: Unpack[TaskArgs]
) -> Callable[[Task[P, R]], LockedTask[P, R | None]]:
    """Run the task only while holding the lock `key` (formatted from the arguments the task
    was enqueued with); put it *above* `@task`. It takes the options of the Celery version
    (every `LockOptions`, `name` defaulting to the key template, and `on_locked`,
    `countdown`, `dedupe`, `on_duplicate`, `dedupe_ttl`), with the same defaults and
    meanings, and `max_retries`.

    When the lock stays held for `timeout` seconds (default 0: don't wait), `on_locked`
    decides: "skip" returns None (the TaskResult succeeds with None) and logs at INFO;
    "raise" fails the task with `LockUnavailable`; "retry" enqueues the task again with
    `run_after` `countdown` seconds from now (default: the holder's remaining time, rounded
    up), as a new TaskResult; after `max_retries` retries (None: no limit) the task fails
    with `LockUnavailable`. A backend that cannot defer (the immediate one) raises instead
    of retrying. A store that cannot be reached fails the task with `LockStoreUnavailable`.

    `auto_extend`, `max_hold`, `on_lost`, `limit` and `shared` mean what they do for `lock()`.

    `dedupe=` stops duplicates at `.enqueue()`, with the Celery version's meaning: "queued"
    returns the TaskResult of a task with the same key that waits to run (nothing is
    enqueued) until it takes its run lock; "until_done" until it ends. `on_duplicate="raise"`
    raises `AlreadyQueued` instead. The claim expires `dedupe_ttl` (default: `ttl`) after the
    enqueue, each retry and the start of an "until_done" run. A task retried by
    `on_locked="retry"` stays the queued one: a duplicate gets the retry's TaskResult.
    """
    parsed = TaskOptions.for_templates(key, options)
    if max_retries is not None and (
        not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0
    ):
        raise ValueError(f"max_retries must be an int >= 0 or None, got {max_retries!r}")

    def decorate(task: Task[P, R]) -> LockedTask[P, R | None]:
        if isinstance(task, LockedTask):
            raise TypeError(f"{task.module_path} already has a locked_task: apply it once")
        if not isinstance(task, Task):
            raise TypeError(
                "locked_task must be applied above @task, not below: put @locked_task(...) on "
                "the line before @task or @task(...)"
            )
        if iscoroutinefunction(task.func):
            raise TypeError(f"locked_task does not lock async tasks yet ({task.module_path})")
        keyed.check_fields(key, task.func)
        locking = _Locking(parsed, key, task.func, task.takes_context, max_retries)
        fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(task) if f.init}
        # Every run gets the TaskContext: its TaskResult names the run (the holder, the claim)
        # and is what a retry enqueues again.
        fields.update(func=locking.wrap(), takes_context=True)
        return LockedTask(**fields)

    return decorate


class LockedTask(Task, Generic[P, R]):  # type: ignore[misc,type-arg]
    """A task `locked_task` made: its runs hold the lock, its `enqueue()` de-duplicates.

    It always takes the TaskContext (`takes_context` is True); the function it was made from
    gets it only if it asked for it."""

    __slots__ = ()

    @property
    def locking(self) -> _Locking:
        return self.func._keel_lock_locking  # type: ignore[attr-defined, no-any-return]

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskResult[P, R]:
        """Queue the task, unless `dedupe=` finds a task with the same key queued (then its
        TaskResult, or AlreadyQueued)."""
        if self.locking.options.dedupe is None:
            return super().enqueue(*args, **kwargs)  # type: ignore[no-any-return]
        return self.locking.enqueue(self, args, kwargs)

    async def aenqueue(self, *args: P.args, **kwargs: P.kwargs) -> TaskResult[P, R]:
        if self.locking.options.dedupe is None:
            return await super().aenqueue(*args, **kwargs)  # type: ignore[no-any-return]
        return await sync_to_async(self.enqueue)(*args, **kwargs)

    def enqueue_plainly(self, args: Any, kwargs: dict[str, Any]) -> TaskResult[P, R]:
        """Queue the task as `Task.enqueue` does: no claim, no de-duplication."""
        return super().enqueue(*args, **kwargs)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class _Locking:
    """How one locked task takes its locks: the run lock in the worker, the claim at enqueue."""

    options: TaskOptions
    key: keyed.KeyTemplates
    fn: Callable[..., Any]
    takes_context: bool
    max_retries: int | None

    def format_key(self, args: Any, kwargs: dict[str, Any]) -> str | list[str]:
        """The run lock's key (keys, for a list of templates) for a task enqueued with
        `args` and `kwargs`. A function that takes the context gets None for it: the key is
        made before there is one. With `dedupe` (one template) it is one key."""
        call_args = (None, *args) if self.takes_context else tuple(args)
        return keyed.format_keys(self.key, self.fn, call_args, kwargs)

    def wrap(self) -> Callable[..., Any]:
        """The function a LockedTask runs: `fn` under the run lock, called with the context
        only if it takes one."""
        fn = self.fn

        @functools.wraps(fn)
        def wrapper(context: TaskContext[Any, Any], *args: Any, **kwargs: Any) -> Any:
            retries = int(kwargs.pop(RETRIES_KWARG, 0) or 0)
            call_args = (context, *args) if self.takes_context else args
            return self.run(context.task_result, call_args, args, kwargs, retries)

        signature = inspect.signature(fn)
        if not self.takes_context:
            # The backend checks that a task taking the context names it first.
            context = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            signature = signature.replace(parameters=[context, *signature.parameters.values()])
        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        wrapper._keel_lock_locking = self  # type: ignore[attr-defined]
        return wrapper

    # -- in the worker ------------------------------------------------------------------------
    def run(
        self,
        result: TaskResult[Any, Any],
        call_args: tuple[Any, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retries: int,
    ) -> Any:
        """One run of the task `result` is: `fn(*call_args, **kwargs)` under the run lock."""
        task = result.task
        label = claim_holder(task.module_path, result.id)
        key = self.format_key(args, kwargs)
        raises = self.options.on_locked == RAISE
        handle = keyed.handle_for(self.options.spec, key, label=label, raises=raises)
        dedupe = self.options.dedupe
        claim = self.find_claim(handle.key, label) if dedupe is not None else None

        def body() -> Any:
            if claim is not None:
                if dedupe == "queued":
                    give_back(claim, logger)  # the work starts: the next enqueue queues anew
                else:
                    extend_claim(claim, claim.ttl, logger)  # dedupe_ttl counts from the start
            return call_holding(handle, lambda: self.fn(*call_args, **kwargs))

        handed_on = False
        try:
            outcome = handle.run(body)
            if outcome.acquired:
                return outcome.value
            handed_on = self.refused(handle, task, label, args, kwargs, retries, claim)
            return None
        finally:
            if claim is not None and not handed_on:
                give_back(claim, logger)

    def refused(
        self,
        handle: Lock,
        task: Task[Any, Any],
        label: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retries: int,
        claim: Lock | None,
    ) -> bool:
        """Do what `on_locked` says for a run that did not get `handle`; True when a retry
        took the run's claim on."""
        on_locked = self.options.on_locked
        if on_locked == SKIP:
            log_skipped(logger, label, handle)
            return False
        error = handle.unavailable(f"{label}: ")
        if on_locked == RAISE or not task.get_backend().supports_defer:
            raise error
        assert on_locked == RETRY
        if self.max_retries is not None and retries >= self.max_retries:
            logger.info("giving up on %s after %s retries: lock %r is held", label, retries,
                        handle.key)  # fmt: skip
            raise error
        countdown = self.options.countdown_for(handle)
        later = task.using(run_after=timezone.now() + timedelta(seconds=countdown))
        assert isinstance(later, LockedTask)
        again = {**kwargs, RETRIES_KWARG: retries + 1}
        if claim is None:
            sent = later.enqueue_plainly(args, again)
        else:
            sent = self.hand_on(later, handle.key, args, again, claim, countdown)
        logger.info(
            "retrying %s as %s in %gs: lock %r is held (retry %s of %s)",
            label,
            sent.id,
            countdown,
            handle.key,
            retries + 1,
            self.max_retries if self.max_retries is not None else "unlimited",
        )
        return claim is not None

    def claim_of(self, key: str, label: str) -> Lock | None:
        """The claim `.enqueue()` took for the run `label` names, if it still lives."""
        probe = self.options.claim(key, label)
        for info in probe.holders():
            if info.holder == label:
                return _adopt(probe, info)
        return None

    def find_claim(self, key: str, label: str) -> Lock | None:
        """The claim `.enqueue()` took for the run `label` names, if any. Not found at once,
        it looks again behind the key's gate: the enqueue that queued this run may not have
        claimed yet, and it holds the gate until it has."""
        claim = self.claim_of(key, label)
        if claim is not None or _enqueuing.get() == key:
            return claim  # inside .enqueue(): it claims nothing for a run that ended
        logger.debug("%s: no claim yet; waiting for the enqueue of %r to end", label, key)
        gate = self.gate(key)
        entered = gate.acquire()  # not entered in _GATE_TTL: its holder is gone
        try:
            return self.claim_of(key, label)
        finally:
            if entered:
                gate.release()

    def hand_on(
        self,
        later: LockedTask[Any, Any],
        key: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        claim: Lock,
        countdown: float,
    ) -> TaskResult[Any, Any]:
        """Enqueue the retry `later` and move `claim` to it, in one step for enqueuers."""
        with self.gated(key) as claims:
            sent = later.enqueue_plainly(args, kwargs)
            give_back(claim, logger)
            holder = claim_holder(later.module_path, sent.id)
            moved = self.options.claim(key, holder, ttl=claim.ttl + countdown)
            if moved.acquire():
                claims.append(moved)
            else:
                logger.warning("claim %r not moved to %s: taken meanwhile", moved.key, sent.id)
        return sent

    # -- at enqueue -------------------------------------------------------------------------
    def gate(self, key: str) -> Lock:
        """The lock that makes check-enqueue-claim one step for the key's enqueuers and for
        the run looking for its claim; named by the template, as the run lock is."""
        name = self.options.spec.name
        return lock(
            key + GATE_SUFFIX,
            store=self.options.spec.store,
            ttl=_GATE_TTL,
            timeout=_GATE_TTL,
            holder=self.options.spec.holder,
            on_lost="warn",
            name=None if name is None else name + GATE_SUFFIX,
        )

    @contextlib.contextmanager
    def gated(self, key: str) -> Iterator[list[Lock]]:
        """Hold `key`'s gate to enqueue and claim; the claims put in the list it yields are
        given back if the gate did not stay held to the end (it expired: a run may have
        looked for its claim meanwhile, found none, and would never give it back)."""
        gate = self.gate(key)
        if not gate.acquire():
            raise gate.unavailable()
        enqueuing = _enqueuing.set(key)
        claims: list[Lock] = []
        try:
            yield claims
        finally:
            _enqueuing.reset(enqueuing)
            if not gate.release():
                for claim in claims:
                    logger.warning("claim %r given back: the gate expired first", claim.key)
                    give_back(claim, logger)

    def enqueue(
        self, task: LockedTask[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> TaskResult[Any, Any]:
        """`task.enqueue(*args, **kwargs)`, unless the key's claim is taken: then the
        TaskResult of the task holding it (or AlreadyQueued), and nothing is enqueued."""
        key = cast(str, self.format_key(args, kwargs))  # dedupe takes one template
        limit = self.options.spec.mode.limit
        with self.gated(key) as claims:
            probe = self.options.claim(key, "?")
            holders = probe.holders()
            if len(holders) >= limit:
                return self.duplicate(task, key, holders[-1])
            sent = task.enqueue_plainly(args, kwargs)
            if sent.is_finished:  # an immediate backend ran it already
                return sent
            claim = self.options.claim(key, claim_holder(task.module_path, sent.id))
            if claim.acquire():
                claims.append(claim)
            else:
                logger.warning("claim %r not taken for %s: taken meanwhile", claim.key, sent.id)
        return sent

    def duplicate(
        self, task: LockedTask[Any, Any], key: str, existing: LockInfo
    ) -> TaskResult[Any, Any]:
        error = self.options.already_queued(task.module_path, key, existing)
        if error.task_id is None or self.options.on_duplicate == RAISE:
            raise error
        try:
            found = task.get_result(error.task_id)
        except (TaskResultDoesNotExist, NotImplementedError):
            raise error from None  # a backend that cannot look results up
        logger.info("not enqueueing %s: %s", task.module_path, error)
        return found


def _adopt(probe: Lock, info: LockInfo) -> Lock:
    """A handle holding the acquisition `info` of `probe`'s key, found in the store."""
    mode = probe.mode.limit if probe.mode.kind == "semaphore" else None
    expires_at = time.time() + info.expires_in
    key, owner, fence, holder = info.key, info.owner, info.fence, info.holder
    token = tokens.Token(key, probe.ttl, owner, fence, holder, probe.store_alias, expires_at, mode)
    return restore_lock(tokens.dumps(token))
