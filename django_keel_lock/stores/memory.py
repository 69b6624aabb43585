"""A per-process store: thread-safe, monotonic clock. For tests and single-process programs."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from time import monotonic
from typing import Any, cast

from django.conf import settings
from django.core.checks import CheckMessage, Warning

from .base import (
    GATE_OWNER,
    PERMIT_OWNERS,
    AcquireResult,
    Kind,
    LockInfo,
    LockStore,
    Mode,
)
from .checks import ID
from .permits import Held, Step, plan_acquire

#: A lock or a permit the store keeps: [owner, holder, fence, acquired_at, expires_at] (the
#: times monotonic), read and written as `entry[EXPIRES_AT]`. A list, made in one step: a
#: class of five slots costs a call and a deallocation more, a tenth of a cycle.
_Entry = list[Any]
OWNER, HOLDER, FENCE, ACQUIRED_AT, EXPIRES_AT = range(5)


#: `AcquireResult(fence)` as `_granted(AcquireResult, (fence, None, None, None, (), None,
#: None))`, every field given (a shorter tuple lacks the last ones): the named tuple's own
#: __new__ is a Python function, a fifth of this store's acquire.
_granted = tuple.__new__


def _prebound(mutex: threading.Lock) -> AbstractContextManager[object]:
    """`mutex` for `with`, entered and left by its own `__enter__` and `__exit__`, bound once:
    a `with` on the mutex itself binds both anew each time (two objects made and freed, a
    twentieth of a memory-store cycle). The same C calls at the same points: a signal
    handler's exception lands before the mutex is taken or once its release is sure, as with
    `with mutex:`, and other threads wait for it alike."""
    # A built-in method is no descriptor: found on the class, `with` calls it as it is.
    methods = {"__slots__": (), "__enter__": mutex.__enter__, "__exit__": mutex.__exit__}
    return cast(AbstractContextManager[object], type("Prebound", (), methods)())


class MemoryLockStore(LockStore):
    """Locks in a dict guarded by a mutex. Coordinates threads of one process only."""

    admin_note = (
        "Locks of this web server process only: a memory store does not coordinate processes."
    )

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        """W001: the "default" store coordinates nothing across the workers of production."""
        if alias != "default" or settings.DEBUG:
            return []
        return [
            Warning(
                'MemoryLockStore is the "default" lock store while DEBUG is False: it only '
                "coordinates threads of one process, so two workers can hold the same lock.",
                hint="Use DatabaseLockStore or RedisLockStore in production.",
                id=ID.format("W001"),
            )
        ]

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        self._mutex = _prebound(threading.Lock())
        self._locks: dict[str, _Entry] = {}
        # A key held by permits: its lock in _locks (owned by the GATE_OWNER), each permit here.
        self._permits: dict[str, dict[str, _Entry]] = {}
        self._writers: dict[str, tuple[str, float]] = {}  # key -> (owner, waits until)
        # One counter for every key: strictly increasing per key, and nothing to forget on prune.
        self._fences = itertools.count(1)
        # Wall-clock anchor so acquired_at can be shown as a datetime.
        self._wall_offset = time.time() - monotonic()

    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None:  # the usual case: `_take` written out, a call less
                fence = next(self._fences)
                self._locks[key] = [owner, holder, fence, now, now + ttl]
                if self._permits:
                    self._permits.pop(key, None)
                return _granted(AcquireResult, (fence, None, None, None, (), None, None))
            if entry[EXPIRES_AT] > now and entry[OWNER] != owner:
                kind = PERMIT_OWNERS.get(entry[OWNER], "exclusive")
                return AcquireResult(None, entry[EXPIRES_AT] - now, kind)
            return self._take(key, entry, owner, holder, ttl, now)

    def _take(
        self, key: str, entry: _Entry | None, owner: str, holder: str, ttl: float, now: float
    ) -> AcquireResult:
        """Give `key` (its lock `entry`: free, expired or `owner`'s) to `owner`, under the
        mutex. The same owner asking again gets its acquisition back, ttl renewed, as the
        contract asks of every store (there, a retry after a lost reply)."""
        if entry is not None and entry[OWNER] == owner and entry[EXPIRES_AT] > now:
            entry[EXPIRES_AT] = now + ttl
            return _granted(AcquireResult, (entry[FENCE], None, None, None, (), None, None))
        fence = next(self._fences)
        self._locks[key] = [owner, holder, fence, now, now + ttl]
        if self._permits:  # an expired gate's permits expired with it
            self._permits.pop(key, None)
        return _granted(AcquireResult, (fence, None, None, None, (), None, None))

    def release(self, key: str, owner: str) -> bool:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry[OWNER] != owner or entry[EXPIRES_AT] <= now:
                return False
            del self._locks[key]
        if key in self.wake_board.watched:  # someone listens: `wake`'s test first
            self.wake_board.wake(key)
        return True

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry[OWNER] != owner or entry[EXPIRES_AT] <= now:
                return False
            entry[EXPIRES_AT] = max(entry[EXPIRES_AT], now + ttl)
            return True

    # -- several keys at once -------------------------------------------------------------
    atomic_many = True  # under the one mutex

    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        now = monotonic()
        with self._mutex:
            locks = self._locks
            held = [(k, e) for k in keys if (e := locks.get(k)) is not None and e[EXPIRES_AT] > now]
            blocked = [(k, e) for k, e in held if e[OWNER] != owner]
            if blocked:
                kind = PERMIT_OWNERS.get(blocked[0][1][OWNER], "exclusive")
                retry_in = min(e[EXPIRES_AT] for _, e in blocked) - now
                return AcquireResult(None, retry_in, kind, None, tuple(k for k, _ in blocked))
            fences = tuple(
                self._taken(key, locks.get(key), owner, holder, ttl, now) for key in keys
            )
        return AcquireResult(max(fences), None, None, fences)

    def _taken(
        self, key: str, entry: _Entry | None, owner: str, holder: str, ttl: float, now: float
    ) -> int:
        """`_take`'s fence."""
        fence = self._take(key, entry, owner, holder, ttl, now).fence
        assert fence is not None
        return fence

    def release_many(self, keys: tuple[str, ...], owner: str) -> bool:
        now = monotonic()
        with self._mutex:
            mine = [k for k in keys if self._owns(k, owner, now)]
            for key in mine:
                del self._locks[key]
        for key in mine:
            self.wake_board.wake(key)
        return len(mine) == len(keys)

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        now = monotonic()
        with self._mutex:
            mine = [k for k in keys if self._owns(k, owner, now)]
            for key in mine:
                entry = self._locks[key]
                entry[EXPIRES_AT] = max(entry[EXPIRES_AT], now + ttl)
        return len(mine) == len(keys)

    def _owns(self, key: str, owner: str, now: float) -> bool:
        """Whether `owner` holds `key`'s lock, alive (under the mutex)."""
        entry = self._locks.get(key)
        return entry is not None and entry[OWNER] == owner and entry[EXPIRES_AT] > now

    # -- permits --------------------------------------------------------------------------
    supports_modes = True

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            writer, writer_until = self._writers.get(key, (None, now))
            permits = self._live_permits(key, now)
            held = Held(
                None if entry is None else entry[OWNER],
                0.0 if entry is None else entry[EXPIRES_AT] - now,
                writer,
                writer_until - now,
                [(o, p[EXPIRES_AT] - now) for o, p in permits.items()],
            )
            plan = plan_acquire(held, owner, mode)
            if plan.step is Step.REFUSE:
                return AcquireResult(None, plan.retry_in, plan.held_as)
            if plan.step is Step.INTEND:
                if writer is None or writer_until <= now or writer == owner:
                    self._writers[key] = (owner, now + writer_wait)
                return AcquireResult(None, plan.retry_in, plan.held_as)
            if plan.step is Step.TAKE:
                if writer == owner:
                    del self._writers[key]
                return self._take(key, entry, owner, holder, ttl, now)
            if plan.step is Step.RENEW:
                permit = permits[owner]
                permit[EXPIRES_AT] = now + ttl
            else:
                permit = [owner, holder, next(self._fences), now, now + ttl]
                if held.owner not in PERMIT_OWNERS or held.left <= 0:  # the first permit
                    self._locks[key] = [GATE_OWNER[mode.kind], "", 0, now, now]
                    permits = self._permits[key] = {}
                permits[owner] = permit
            gate = self._locks[key]
            gate[FENCE] = max(gate[FENCE], permit[FENCE])
            gate[EXPIRES_AT] = max(gate[EXPIRES_AT], permit[EXPIRES_AT])
            return AcquireResult(permit[FENCE])

    def release_permit(self, key: str, owner: str) -> bool:
        now = monotonic()
        with self._mutex:
            permits = self._live_permits(key, now)
            if owner not in permits:
                return False
            del permits[owner]
            gate = self._locks[key]
            if permits:
                gate[EXPIRES_AT] = max(p[EXPIRES_AT] for p in permits.values())
            else:
                del self._locks[key]
                self._permits.pop(key, None)
        self.wake_board.wake(key)
        return True

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        now = monotonic()
        with self._mutex:
            permit = self._live_permits(key, now).get(owner)
            if permit is None:
                return False
            permit[EXPIRES_AT] = max(permit[EXPIRES_AT], now + ttl)
            gate = self._locks[key]
            gate[EXPIRES_AT] = max(gate[EXPIRES_AT], permit[EXPIRES_AT])
            return True

    def holders(self, key: str) -> list[LockInfo]:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry[EXPIRES_AT] <= now:
                return []
            if entry[OWNER] not in PERMIT_OWNERS:
                return [self._info(key, entry, now)]
            kind = PERMIT_OWNERS[entry[OWNER]]
            infos = [self._info(key, p, now, kind) for p in self._live_permits(key, now).values()]
        return sorted(infos, key=lambda info: (info.expires_in, info.fence))

    def _live_permits(self, key: str, now: float) -> dict[str, _Entry]:
        """The permits of `key` (its dict, expired ones dropped), when permits hold it."""
        entry = self._locks.get(key)
        if entry is None or entry[OWNER] not in PERMIT_OWNERS or entry[EXPIRES_AT] <= now:
            self._permits.pop(key, None)
            return {}
        permits = self._permits.setdefault(key, {})
        for dead in [o for o, p in permits.items() if p[EXPIRES_AT] <= now]:
            del permits[dead]
        return permits

    def get(self, key: str) -> LockInfo | None:
        now = monotonic()
        with self._mutex:
            entry = self._locks.get(key)
            if entry is None or entry[EXPIRES_AT] <= now:
                return None
            return self._info(key, entry, now)

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        now = monotonic()
        with self._mutex:
            items = [(k, e) for k, e in self._locks.items() if k.startswith(prefix)]
        for key, entry in sorted(items, key=lambda item: item[0]):
            if entry[OWNER] in PERMIT_OWNERS:
                yield from self.holders(key)
            elif entry[EXPIRES_AT] > now:
                yield self._info(key, entry, now)

    def prune(self) -> int:
        now = monotonic()
        with self._mutex:
            dead = [k for k, e in self._locks.items() if e[EXPIRES_AT] <= now]
            for key in dead:
                del self._locks[key]
                self._permits.pop(key, None)
            for key in [k for k, (_, until) in self._writers.items() if until <= now]:
                del self._writers[key]
        return len(dead)

    @property
    def push_wakeups(self) -> bool:
        return True  # every holder lives in this process, so every release wakes directly

    def _info(self, key: str, entry: _Entry, now: float, mode: Kind = "exclusive") -> LockInfo:
        acquired = datetime.fromtimestamp(entry[ACQUIRED_AT] + self._wall_offset, tz=UTC)
        return LockInfo(
            key=key,
            owner=entry[OWNER],
            holder=entry[HOLDER],
            fence=entry[FENCE],
            acquired_at=acquired,
            expires_in=max(0.0, entry[EXPIRES_AT] - now),
            mode=mode,
        )

    def advance_clock(self, seconds: float) -> None:
        """Age every lock by `seconds`: lets a test see expiry without sleeping."""
        with self._mutex:
            permits = [p for each in self._permits.values() for p in each.values()]
            for entry in [*self._locks.values(), *permits]:
                entry[EXPIRES_AT] -= seconds
                entry[ACQUIRED_AT] -= seconds
            self._writers = {k: (o, until - seconds) for k, (o, until) in self._writers.items()}
