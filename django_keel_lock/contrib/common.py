"""What `locked_task` shares between task frameworks (contrib.celery, contrib.tasks).

Both take the same options and mean the same by them: `TaskOptions` checks them once, where
the task is defined. Both refuse a run alike (`log_skipped`, `TaskOptions.countdown_for`) and
de-duplicate with the same *claim*: a lock on the run lock's key plus CLAIM_SUFFIX whose
holder is `<task>[<task id>]`, so a duplicate can say which task it folds into (`claimant`).
Only how the claim reaches the worker differs (a message header for Celery, the claim's holder
for Django Tasks). Nothing here imports a task framework.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Final, Literal, TypeVar, Unpack

from .. import keyed
from ..core import Lock
from ..durations import Duration, to_seconds
from ..exceptions import AlreadyQueued, LockError, LockStoreUnavailable
from ..options import RAISE, RETRY, SKIP, LockOptions, LockSpec, OnLocked, check_on_locked
from ..stores.base import LockInfo

__all__ = [
    "CLAIM_SUFFIX",
    "DEFAULT_RETRY_COUNTDOWN",
    "QUEUED",
    "RETURN",
    "UNTIL_DONE",
    "Dedupe",
    "OnDuplicate",
    "TaskArgs",
    "TaskOptions",
    "current_lock",
]

T = TypeVar("T")

#: Seconds before a retry when the holder's remaining time is unknown (it just released).
DEFAULT_RETRY_COUNTDOWN = 1.0
ON_LOCKED: tuple[OnLocked, ...] = (SKIP, RAISE, RETRY)

# -- dedupe: what a duplicate send finds ------------------------------------------------------
#: Claim released when the task takes its run lock: one running and one queued at most.
QUEUED: Final = "queued"
#: Claim released when the task ends: one queued or running at most.
UNTIL_DONE: Final = "until_done"
Dedupe = Literal["queued", "until_done"]
#: What a duplicate send does: return the existing task's result, or raise AlreadyQueued.
RETURN: Final = "return"
OnDuplicate = Literal["return", "raise"]
#: The claim's key is the run lock's key and this: the two never meet in the store.
CLAIM_SUFFIX = ":claim"

_current: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_keel_lock_task_lock", default=None
)


def current_lock() -> Lock | None:
    """The lock the running `locked_task` holds (to pass its `fence` on), None outside one."""
    return _current.get()


def call_holding(handle: Lock, fn: Callable[[], T]) -> T:
    """`fn()` with `handle` as `current_lock()` while it runs."""
    token = _current.set(handle)
    try:
        return fn()
    finally:
        _current.reset(token)


#: The arguments of `locked_task` that say how to take the run lock: the `LockOptions`.
LockArgs = LockOptions


class TaskArgs(LockOptions, total=False):
    """Every argument of `locked_task` but the key (`TaskOptions.parse` reads them): the
    `LockOptions` and the task's own."""

    on_locked: OnLocked
    countdown: Duration | None
    dedupe: Dedupe | None
    on_duplicate: OnDuplicate
    dedupe_ttl: Duration | None


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """What a `locked_task` was given besides its key, checked where the task is defined."""

    spec: LockSpec
    on_locked: OnLocked
    countdown: float | None  # None: the holder's remaining time
    dedupe: Dedupe | None
    on_duplicate: OnDuplicate
    dedupe_ttl: float | None  # None: the run lock's ttl

    @classmethod
    def parse(
        cls,
        *,
        on_locked: OnLocked = SKIP,
        countdown: Duration | None = None,
        dedupe: Dedupe | None = None,
        on_duplicate: OnDuplicate = RETURN,
        dedupe_ttl: Duration | None = None,
        **lock: Unpack[LockOptions],
    ) -> TaskOptions:
        """Check and convert `locked_task`'s arguments; a bad value raises naming it."""
        check_on_locked(on_locked, ON_LOCKED)
        spec = LockSpec.parse("locked_task", **lock)
        if countdown is not None and on_locked != RETRY:
            raise ValueError('countdown= only applies to on_locked="retry"')
        if dedupe not in (None, QUEUED, UNTIL_DONE):
            raise ValueError(f'dedupe must be None, "queued" or "until_done", got {dedupe!r}')
        if on_duplicate not in (RETURN, RAISE):
            raise ValueError(f'on_duplicate must be "return" or "raise", got {on_duplicate!r}')
        if dedupe is None and (on_duplicate != RETURN or dedupe_ttl is not None):
            raise ValueError(
                'on_duplicate= and dedupe_ttl= only apply with dedupe="queued" or "until_done"'
            )
        return cls(
            spec=spec,
            on_locked=on_locked,
            countdown=None
            if countdown is None
            else to_seconds("countdown", countdown, allow_zero=True),
            dedupe=dedupe,
            on_duplicate=on_duplicate,
            dedupe_ttl=None if dedupe_ttl is None else to_seconds("dedupe_ttl", dedupe_ttl),
        )

    @classmethod
    def for_templates(cls, key: keyed.KeyTemplates, options: TaskArgs) -> TaskOptions:
        """`parse` for a task locked on `key` (one template or a list of them), checked where
        the task is defined rather than in the worker on its first run."""
        keyed.check_templates(key)
        keyed.name_templates(options, key)
        parsed = cls.parse(**options)
        if parsed.dedupe is not None and isinstance(key, list | tuple):
            raise TypeError(
                "dedupe= takes one key template (the claim of a queued task is one key), got a "
                "list: drop dedupe=, or dedupe on one key that stands for the group"
            )
        return parsed

    def countdown_for(self, handle: Lock) -> float:
        """Seconds before retrying a run refused `handle`: `countdown`, else the holder's
        remaining time rounded up (DEFAULT_RETRY_COUNTDOWN when it is unknown)."""
        if self.countdown is not None:
            return self.countdown
        remaining = handle.remaining_time()
        return max(1.0, float(math.ceil(remaining))) if remaining else DEFAULT_RETRY_COUNTDOWN

    def claim_ttl(self) -> float:
        """How long a claim lives unless extended: `dedupe_ttl`, else the run lock's ttl."""
        return self.spec.resolved_ttl() if self.dedupe_ttl is None else self.dedupe_ttl

    def claim(self, key: str, holder: str, ttl: float | None = None) -> Lock:
        """The handle on `key`'s claim (the run lock's key) for the task `holder` names:
        `<task>[<task id>]`, which `claimant` reads back; it lives `ttl` (default
        `claim_ttl()`) once taken."""
        spec = dataclasses.replace(
            self.spec,
            ttl=self.claim_ttl() if ttl is None else ttl,
            timeout=0.0,
            holder=holder,
            auto_extend=False,
            max_hold=None,
            name=None if self.spec.name is None else self.spec.name + CLAIM_SUFFIX,
        )
        return spec.lock(key + CLAIM_SUFFIX)

    def already_queued(self, task: str, key: str, existing: LockInfo) -> AlreadyQueued:
        """The error for a duplicate of the task whose claim is `existing`."""
        task_id = claimant(existing.holder, task)
        state = "queued" if self.dedupe == QUEUED else "queued or running"
        return AlreadyQueued(
            key,
            task_id,
            f"{task}: a task with key {key!r} is already {state} "
            f"({task_id or existing.holder}); nothing was sent",
        )


def claim_holder(task: str, task_id: str) -> str:
    """The holder of a claim taken for the task `task_id`: `<task>[<task id>]`."""
    return f"{task}[{task_id}]"


def claimant(holder: str, task: str) -> str | None:
    """The task id in a claim's holder `<task>[<task id>]`, None if it is not one."""
    prefix = f"{task}["
    if holder.startswith(prefix) and holder.endswith("]"):
        return holder[len(prefix) : -1] or None
    return None


def log_skipped(logger: logging.Logger, label: str, handle: Lock) -> None:
    """Say at INFO that the run `label` was skipped and who holds `handle`'s key."""
    found = handle.info()  # a multi-key lock's: each key's holder, or None where free
    many = isinstance(found, dict)
    infos = list(found.values()) if isinstance(found, dict) else [found]
    held_by = "; ".join(
        f"{f'{i.key}: ' if many else ''}{i.holder} (fence {i.fence}, {i.expires_in:.1f}s left)"
        for i in infos
        if i is not None
    )
    logger.info("skipped %s: %s is held by %s", label, handle.describe(), held_by or "?")


def take_claim(claim: Lock, task: str) -> LockInfo | None:
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
        f"claim {claim.key!r} changed hands on every attempt; {task} was not sent"
    )


def extend_claim(claim: Lock, seconds: float, logger: logging.Logger) -> bool:
    """Make `claim` live `seconds` more; False (logged) when it is gone or unreachable: the
    task goes on without it, and a duplicate may then be queued."""
    try:
        claim.extend(max(seconds, 0.001))
        return True
    except LockError as exc:
        logger.warning("claim %r not kept: %s", claim.key, exc)
        give_back(claim, logger)
        return False


def give_back(claim: Lock, logger: logging.Logger) -> None:
    """Release `claim` if still held; a store outage only logs: it expires at its ttl."""
    try:
        claim.release()
    except LockStoreUnavailable as exc:
        logger.warning("claim %r not released (%s); it expires in %gs", claim.key, exc, claim.ttl)
