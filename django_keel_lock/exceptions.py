"""Errors raised by django-keel-lock. Every one is a LockError."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class LockError(Exception):
    """Base class of every error this package raises on purpose."""


class LockNotHeldError(LockError):
    """The handle does not hold its lock (expired, taken over or force-released)."""


class LockUnavailable(LockError):
    """Someone else held the lock for the whole wait (context manager, decorators)."""

    def __init__(self, key: str, message: str | None = None) -> None:
        self.key = key
        # Both in args: pickle and Celery's JSON results remake an exception as cls(*args).
        super().__init__(key, message or f"lock {key!r} is held by someone else")

    def __str__(self) -> str:
        return str(self.args[-1])


class LockStoreUnavailable(LockError):
    """The store itself failed (connection refused, timeout, database down).

    Never means "someone else holds it": the state of the lock is unknown.
    """


class LockStoreMisconfigured(LockError, ImproperlyConfigured):
    """The store is set up wrongly (its database lacks the lock tables: not migrated), so
    every call fails the same way until someone fixes it. Not an outage (retrying will not
    help) and not "held elsewhere"; the message says what to run."""


class InvalidLockToken(LockError, ValueError):
    """A serialized lock token was garbage, truncated, tampered with or signed by another key."""


class AlreadyQueued(LockError):
    """Nothing was sent: a task with the same key is already queued (or, with
    `dedupe="until_done"`, running). `task_id` is that task's id (None if it cannot be told)."""

    def __init__(self, key: str, task_id: str | None, message: str | None = None) -> None:
        self.key = key
        self.task_id = task_id
        # All in args, as LockUnavailable's.
        super().__init__(
            key, task_id, message or f"a task with key {key!r} is already queued: {task_id}"
        )

    def __str__(self) -> str:
        return str(self.args[-1])
