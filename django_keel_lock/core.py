"""The Lock handle: the one place that knows how waiting, ownership and fencing work.

Every surface (context manager, view decorator, management command, admin, Celery) goes
through `Lock`; stores below only answer atomic questions (see `stores.base.LockStore`).
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar

from django.core import signing

from . import signals
from .conf import conf, get_lock_store
from .durations import Duration, to_seconds
from .exceptions import InvalidLockToken, LockError, LockNotHeldError, LockUnavailable
from .stores.base import AcquireResult, LockInfo, LockStore

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")

DEFAULT_RETRY_DELAY = 0.05
TOKEN_SALT = "django_keel_lock.token"
MAX_HOLDER_LENGTH = 255
_HOSTNAME = socket.gethostname()


class LockOutcome(NamedTuple, Generic[T]):
    """What `Lock.run` did: `acquired` is False when fn was not called (then `value` is None)."""

    acquired: bool
    value: T | None


def default_holder() -> str:
    """`<hostname>:<pid>`, computed now so a forked child names itself."""
    return f"{_HOSTNAME}:{os.getpid()}"


def validate_key(key: object, store: LockStore | None = None) -> str:
    """Return `key` if it is a usable lock key, else raise naming the argument."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("key must be a non-empty string")
    if "\x00" in key:
        raise ValueError("key must not contain NUL characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"key must be encodable as UTF-8 ({exc.reason})") from None
    limit = store.max_key_length if store is not None else None
    if limit is not None and len(key) > limit:
        raise ValueError(
            f"key is {len(key)} characters long; store {store.alias!r} "  # type: ignore[union-attr]
            f"accepts at most {limit}"
        )
    return key


KeyTemplate = str | Callable[..., str]


def format_key(
    template: KeyTemplate, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key for one call of `fn`: `template` formatted with the call's bound arguments
    ("report:{date}", "{self.pk}" works too), or `template(*args, **kwargs)` if callable.

    The one key formatter every decorator (locked, locked_task) uses.
    """
    if callable(template):
        return validate_key(template(*args, **kwargs))
    if not isinstance(template, str):
        raise TypeError(f"key must be a str template or a callable, got {type(template).__name__}")
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"cannot bind arguments of {fn.__qualname__} for key {template!r}: {exc}"
        ) from None
    bound.apply_defaults()
    try:
        return validate_key(template.format(**bound.arguments))
    except (KeyError, AttributeError, IndexError) as exc:
        names = ", ".join(bound.arguments) or "none"
        raise ValueError(
            f"key template {template!r} names {exc} which {fn.__qualname__} does not have "
            f"(its arguments: {names})"
        ) from None


def _validate_holder(holder: object) -> str:
    if not isinstance(holder, str):
        raise TypeError(f"holder must be a str, got {type(holder).__name__}")
    if not holder or len(holder) > MAX_HOLDER_LENGTH or "\x00" in holder:
        raise ValueError(
            f"holder must be 1 to {MAX_HOLDER_LENGTH} characters without NUL, got {holder!r:.80}"
        )
    return holder


def next_delay(retry_delay: float, retry_in: float | None, push: bool) -> float:
    """How long a waiter sleeps before its next attempt.

    With push wake-ups a release wakes the waiter at once, so it only needs to look again when
    the holder's lock would expire on its own. Without them it polls every `retry_delay` (with
    jitter so waiters spread out), and never sleeps past the holder's expiry.
    """
    if push and retry_in is not None:
        return retry_in * random.uniform(1.0, 1.1) + 0.001
    delay = retry_delay * random.uniform(0.5, 1.5)
    if retry_in is not None:
        delay = min(delay, retry_in + 0.001)
    return delay


class Lock:
    """A handle on one key in one store. Not shared between threads: make one per worker.

    A handle acquires at most once at a time; each acquisition gets a fresh random `owner`
    token and a `fence` strictly greater than every earlier fence of the key in that store.
    """

    def __init__(
        self,
        key: str,
        *,
        ttl: Duration | None = None,
        timeout: Duration = 0,
        retry_delay: Duration = DEFAULT_RETRY_DELAY,
        store: str = "default",
        holder: str | None = None,
    ) -> None:
        if not isinstance(store, str):
            raise TypeError(f"store must be an alias (str), got {type(store).__name__}")
        self._store = get_lock_store(store)
        self.key = validate_key(key, self._store)
        self.ttl = to_seconds("ttl", conf.DEFAULT_TTL if ttl is None else ttl)
        self.timeout = to_seconds("timeout", timeout, allow_zero=True)
        self.retry_delay = to_seconds("retry_delay", retry_delay, allow_zero=True)
        self.holder = default_holder() if holder is None else _validate_holder(holder)
        self.store_alias = store
        self.owner: str | None = None
        self.fence: int | None = None
        self._held = False

    # -- acquiring ------------------------------------------------------------------------
    def acquire(self, timeout: Duration | None = None, retry_delay: Duration | None = None) -> bool:
        """Take the lock, waiting up to `timeout` seconds (default: the handle's, 0 = no wait).

        True if acquired. Raises LockStoreUnavailable if the store cannot be reached.
        """
        wait = self.timeout if timeout is None else to_seconds("timeout", timeout, allow_zero=True)
        delay = (
            self.retry_delay
            if retry_delay is None
            else to_seconds("retry_delay", retry_delay, allow_zero=True)
        )
        owner = self._begin()
        store = self._store
        result = (
            store.acquire(self.key, owner, self.holder, self.ttl)
            if wait <= 0
            else self._wait(owner, wait, delay)
        )
        return self._finish(owner, result)

    def _begin(self) -> str:
        if self._held:
            raise LockError(
                f"this handle already holds {self.key!r}; release it first or make a new handle"
            )
        return secrets.token_hex(16)

    def _finish(self, owner: str, result: AcquireResult) -> bool:
        if result.fence is None:
            logger.debug("lock %r is held by someone else", self.key)
            return False
        self.owner, self.fence, self._held = owner, result.fence, True
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(sender=Lock, lock=self)
        return True

    def _wait(self, owner: str, timeout: float, retry_delay: float) -> AcquireResult:
        store = self._store
        deadline = time.monotonic() + timeout
        with store.watch(self.key) as waiter:
            while True:
                result = store.acquire(self.key, owner, self.holder, self.ttl)
                left = deadline - time.monotonic()
                if result.fence is not None or left <= 0:
                    return result
                waiter.wait(min(left, next_delay(retry_delay, result.retry_in, store.push_wakeups)))

    # -- holding --------------------------------------------------------------------------
    def release(self) -> bool:
        """Free the lock if we still own it. False if it had expired or was taken over.

        On LockStoreUnavailable the handle keeps its owner, so release can be called again.
        """
        if not self._held or self.owner is None:
            return False
        released = self._store.release(self.key, self.owner)
        self._held = False
        if released:
            if signals.lock_released.receivers:
                signals.lock_released.send(sender=Lock, lock=self)
        else:
            self._lost("release found the lock expired or taken over")
        return released

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lock live at least `ttl` more seconds (default: the lock's ttl).

        Raises LockNotHeldError if the lock was lost; the handle then no longer holds it.
        """
        seconds = self.ttl if ttl is None else to_seconds("ttl", ttl)
        if not self._held or self.owner is None:
            raise LockNotHeldError(f"cannot extend {self.key!r}: this handle does not hold it")
        if not self._store.extend(self.key, self.owner, seconds):
            self._held = False
            self._lost("extend found the lock expired or taken over")
            raise LockNotHeldError(
                f"cannot extend {self.key!r}: the lock expired or was taken over (fence "
                f"{self.fence})"
            )

    def _lost(self, reason: str) -> None:
        logger.warning("lock %r (fence %s) was lost: %s", self.key, self.fence, reason)
        signals.lock_lost.send(sender=Lock, lock=self, reason=reason)

    # -- inspection -----------------------------------------------------------------------
    def info(self) -> LockInfo | None:
        """The live lock on this key (ours or another holder's), or None if it is free."""
        return self._store.get(self.key)

    def is_locked(self) -> bool:
        """Does anyone (not necessarily this handle) hold the key right now?"""
        return self._store.get(self.key) is not None

    def is_expired(self) -> bool:
        """True when this handle acquired the lock and no longer holds it in the store."""
        if self.owner is None:
            return False
        info = self._store.get(self.key)
        return info is None or info.owner != self.owner

    def remaining_time(self) -> float | None:
        """Seconds until the key's current lock expires, None when nobody holds it."""
        info = self._store.get(self.key)
        return None if info is None else info.expires_in

    @property
    def held(self) -> bool:
        """Whether this handle believes it holds the lock (no store round trip)."""
        return self._held

    @property
    def store(self) -> LockStore:
        return self._store

    # -- running --------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]:
        """Acquire, call `fn()`, always release. `(False, None)` and fn not called if not
        acquired within `timeout`; store failures raise LockStoreUnavailable."""
        if not self.acquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        try:
            value = fn()
        finally:
            self.release()
        return LockOutcome(True, value)

    def run_immediately(self, fn: Callable[[], T]) -> LockOutcome[T]:
        """`run` that never waits: fn runs only if the lock is free right now."""
        return self.run(fn, timeout=0)

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise LockUnavailable(
                self.key, f"lock {self.key!r} is held by someone else (waited {self.timeout:g}s)"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # -- handing over ---------------------------------------------------------------------
    def serialize(self) -> str:
        """A signed token another process can pass to `restore_lock` to extend or release."""
        if self.owner is None or not self._held:
            raise LockNotHeldError(f"cannot serialize {self.key!r}: this handle does not hold it")
        payload = {
            "k": self.key,
            "t": self.ttl,
            "o": self.owner,
            "f": self.fence,
            "h": self.holder,
            "s": self.store_alias,
        }
        return signing.dumps(payload, salt=TOKEN_SALT, compress=True)

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "not held"
        return f"<Lock {self.key!r} store={self.store_alias!r} {state}>"


def lock(
    key: str,
    *,
    ttl: Duration | None = None,
    timeout: Duration = 0,
    retry_delay: Duration = DEFAULT_RETRY_DELAY,
    store: str = "default",
    holder: str | None = None,
) -> Lock:
    """A handle on `key` in `store`; nothing is acquired until acquire/run/`with`."""
    return Lock(key, ttl=ttl, timeout=timeout, retry_delay=retry_delay, store=store, holder=holder)


def restore_lock(token: str) -> Lock:
    """The handle `Lock.serialize` described, holding the same acquisition (same owner, fence).

    Raises InvalidLockToken for garbage, truncated, tampered or foreign tokens.
    """
    if not isinstance(token, str):
        raise InvalidLockToken(f"lock token must be a str, got {type(token).__name__}")
    try:
        data = signing.loads(token, salt=TOKEN_SALT)
    except signing.BadSignature as exc:
        raise InvalidLockToken(
            "lock token is not valid: it was altered, truncated, or signed with another SECRET_KEY"
        ) from exc
    except Exception as exc:  # undecodable payload behind a valid signature cannot happen,
        raise InvalidLockToken(f"lock token could not be decoded: {exc}") from exc  # but be sure
    if not isinstance(data, dict) or not _token_shape_ok(data):
        raise InvalidLockToken("lock token is signed but does not describe a lock")
    handle = Lock(data["k"], ttl=data["t"], store=data["s"], holder=data["h"])
    handle.owner, handle.fence, handle._held = data["o"], data["f"], True
    return handle


def _token_shape_ok(data: dict[str, Any]) -> bool:
    types: dict[str, type | tuple[type, ...]] = {
        "k": str,
        "t": (int, float),
        "o": str,
        "f": int,
        "h": str,
        "s": str,
    }
    return all(isinstance(data.get(name), kind) for name, kind in types.items())


def force_release(
    key: str, *, store: str = "default", user: object | None = None
) -> LockInfo | None:
    """Free `key` in the store `store` whoever holds it; the lock that was freed, or None.

    The one force release behind `manage.py locks release` and the admin: it logs a WARNING when
    it frees a lock and always sends `lock_force_released` (info=None: nothing was held).
    """
    if not isinstance(store, str):
        raise TypeError(f"store must be an alias (str), got {type(store).__name__}")
    lock_store = get_lock_store(store)
    validate_key(key, lock_store)
    info = lock_store.force_release(key)
    if info is not None:
        logger.warning(
            "lock %r in store %r (holder %s, fence %s) was force-released by %s",
            key,
            store,
            info.holder,
            info.fence,
            user if user is not None else "a script",
        )
    signals.lock_force_released.send(sender=Lock, key=key, store=store, info=info, user=user)
    return info
