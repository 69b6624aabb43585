"""The LockStore protocol every store implements, and the data it answers with.

A store is a dumb, atomic key/owner table with expiry: it never waits, never retries and never
decides policy. Waiting, ownership tokens and fencing rules live in `django_keel_lock.core`.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

from ..conf import validate_store_options
from ..exceptions import LockStoreUnavailable
from .wakeups import WakeBoard

if TYPE_CHECKING:
    from django.core.checks import CheckMessage

T = TypeVar("T")
_executor_mutex = threading.Lock()


Kind = Literal["exclusive", "shared", "semaphore"]


class Mode(NamedTuple):
    """How a key is held: one exclusive holder, any number of shared holders (readers), or at
    most `limit` semaphore permits. Exclusive and shared are one family (a writer excludes
    readers); a semaphore is the other, and a key is used by one family at a time."""

    kind: Kind
    limit: int = 1  # semaphore: the most permits at once, as this caller counts them

    @property
    def family(self) -> str:
        return "semaphore" if self.kind == "semaphore" else "rw"

    def __str__(self) -> str:
        return f"semaphore({self.limit})" if self.kind == "semaphore" else self.kind


EXCLUSIVE = Mode("exclusive")
SHARED = Mode("shared")


def semaphore_mode(limit: int) -> Mode:
    return Mode("semaphore", limit)


#: The owner a store writes on a key's lock while permits (shared or semaphore) hold it: the
#: key then looks held to every exclusive acquirer, whose path stays as it was. Owner tokens
#: are hex, so no caller's owner is ever one of these.
PERMIT_OWNERS: Mapping[str, Kind] = {"*shared": "shared", "*semaphore": "semaphore"}
GATE_OWNER: Mapping[Kind, str] = {"shared": "*shared", "semaphore": "*semaphore"}

#: The most distinct keys one lock may take at once (`lock([...])`, `LockStore.acquire_many`).
MAX_KEYS = 64

#: Seconds a waiter's place in a key's line lasts after its last attempt (see
#: `LockStore.acquire_queued`); waiters in a line ask again at least twice as often.
QUEUE_LEASE = 2.0


@dataclass(frozen=True)
class LockInfo:
    """One holder of a key (a lock, or one permit) as a store saw it when it was read."""

    key: str
    owner: str
    holder: str
    fence: int
    acquired_at: datetime | None
    expires_in: float  # seconds left, by the store's own clock
    mode: Kind = "exclusive"

    @property
    def is_gate(self) -> bool:
        """True for the stand-in lock of a key held by permits (see PERMIT_OWNERS): its
        holders are `LockStore.holders(key)`."""
        return self.owner in PERMIT_OWNERS


class AcquireResult(NamedTuple):
    """What one acquire attempt gave: a fence when acquired, else how long the holder has left
    and, where the store knows it, how the key is held (`Kind`)."""

    fence: int | None
    retry_in: float | None = None  # seconds until the current holder's lock expires, if known
    held_as: Kind | None = None
    #: A multi-key acquire (`LockStore.acquire_many`) that took its keys: each key's fence,
    #: in the order of its `keys` (`fence` is then the greatest of them).
    fences: tuple[int, ...] | None = None
    #: A refused multi-key acquire: the keys someone else holds, as far as the store looked
    #: (at least one); a waiter listens for their releases.
    blocked: tuple[str, ...] = ()
    #: A refusal of `acquire_queued` by a store that carries grants in its wake-ups
    #: (`WakeBoard.grant`): the key's last fence drawn as it refused. A carried grant of a
    #: fence no greater was made before that refusal and is stale.
    last_fence: int | None = None
    #: A grant the store handed over before it was on disk (a capped grant, `WakeBoard.grant`):
    #: the seconds it is sure to last, from the attempt's send time, until a confirming
    #: extend (the handle sends one at once) answers; None for any other result.
    good_for: float | None = None

    @property
    def acquired(self) -> bool:
        return self.fence is not None


class LockStore(ABC):
    """Where locks live. Every operation is atomic on the store's side and never waits.

    Times are seconds (float). Expiry is judged by the store's own clock, never the caller's.
    Any failure to reach the store raises `LockStoreUnavailable`, never a "not acquired".
    """

    #: Longest key this store accepts (None: no limit of its own).
    max_key_length: int | None = None
    #: Known options (upper-case names in KEEL_LOCK_STORES[alias]["OPTIONS"]).
    option_names: frozenset[str] = frozenset()
    #: True when the store implements the permit operations (semaphores and shared locks);
    #: it then sets `AcquireResult.held_as` on every refusal.
    supports_modes: bool = False
    #: True when the server itself deletes a lock once it expires (Redis key TTLs): `prune()`
    #: then has nothing to do, and `locks prune` says so rather than "pruned 0".
    expires_by_itself: bool = False
    #: Seconds a lock may outlive its ttl on this store, when its server keeps coarser time
    #: (etcd's leases count whole seconds): a lock lives at least its ttl, at most this more.
    expiry_slack: float = 0.0
    #: True when the store keeps a line of the callers waiting for each exclusive lock
    #: (`acquire_queued`, `leave_queue`): a release then wakes only the first of them.
    queues: bool = False
    #: True (with `queues`) when a release that finds a live waiter first in line hands the
    #: lock over to it in the same atomic step (its owner, holder and a new fence, for
    #: min(its ttl, QUEUE_LEASE)) before waking it; its next `acquire_queued` takes the grant
    #: up at its own ttl. Nobody else, in line or not, can take the lock in between. A store
    #: whose wake-up can carry the grant instead grants it at the waiter's whole ttl and
    #: passes it to `WakeBoard.grant`, and the waiter takes it with no call (see `engine`;
    #: Redis, PostgreSQL and MariaDB, while the waiter's process listens).
    hands_off: bool = False

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        self.alias = alias
        self.options = dict(options or {})
        validate_store_options(alias, type(self), self.options)
        self.wake_board = WakeBoard()

    # -- the atomic operations ------------------------------------------------------------
    @abstractmethod
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        """Take `key` for `owner` if it is free or expired, with a fence greater than any this
        store gave `key` before. Otherwise report how long the holder has left."""

    @abstractmethod
    def release(self, key: str, owner: str) -> bool:
        """Free `key` if `owner` still holds it (and it has not expired); True if it did."""

    @abstractmethod
    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Make `owner`'s lock live at least `ttl` more seconds; False if `owner` lost it."""

    @abstractmethod
    def get(self, key: str) -> LockInfo | None:
        """The live lock on `key`, or None when it is free or expired."""

    # -- several keys at once ------------------------------------------------------------
    # A multi-key lock holds each of its keys as an exclusive lock of that key (owner, holder,
    # fence and expiry per key, the same owner on each), so single-key locks of the same keys
    # exclude it and it excludes them. The keys are taken all or nothing: a caller never
    # holds some of them while it waits for the rest, so no order of callers can deadlock.
    #: True when `acquire_many` takes the keys in one atomic step of the store's own (one
    #: script, statement or transaction): no other caller ever sees a part of them taken.
    #: False: they are taken one by one in key order, a refusal giving back those taken.
    atomic_many: bool = False

    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        """Take every one of `keys` (distinct, sorted) for `owner`, or none of them. Each key
        must be free, expired or `owner`'s already (its ttl is then renewed, as `acquire`
        does for a retry after a lost reply); each one taken gets a fence greater than any
        this store gave that key before (`fences`, in the order of `keys`).

        Refused: `blocked` names the keys held by others, `retry_in` is the soonest expiry
        among their holders, `held_as` how the first of them is held.

        This default takes the keys one by one in order with `acquire` and gives back those
        it took at the first refusal (or error): correct on every store, but a partial take
        is briefly visible to others. Stores override it with one atomic step."""
        taken: list[str] = []
        fences: list[int] = []
        try:
            for key in keys:
                taken.append(key)  # before the call: one whose reply is lost may have taken it
                result = self.acquire(key, owner, holder, ttl)
                if result.fence is None:
                    taken.pop()
                    self._give_back_keys(taken, owner)
                    return AcquireResult(None, result.retry_in, result.held_as, None, (key,))
                fences.append(result.fence)
        except BaseException:
            self._give_back_keys(taken, owner)
            raise
        return AcquireResult(max(fences), None, None, tuple(fences))

    def _give_back_keys(self, keys: Sequence[str], owner: str) -> None:
        """Release `owner`'s `keys` taken by a multi-key acquire that is refused or failing;
        a key that cannot be released now lives out its ttl."""
        for key in reversed(keys):
            try:
                self.release(key, owner)
            except Exception:  # the store fails: the key lives out its ttl
                pass

    def release_many(self, keys: tuple[str, ...], owner: str) -> bool:
        """Free each of `keys` that `owner` still holds; True if it held every one. A key
        whose release fails does not keep the others held: each is tried, and the first
        failure raised after."""
        every, failed = True, None
        for key in keys:
            try:
                every = self.release(key, owner) and every
            except LockStoreUnavailable as error:
                failed = failed or error
        if failed is not None:
            raise failed
        return every

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        """Make each of `keys` that `owner` still holds live at least `ttl` more seconds;
        True if it held every one (False: the multi-key lock is lost)."""
        extended = [self.extend(key, owner, ttl) for key in keys]
        return all(extended)

    # -- the line of waiters (stores with queues) ----------------------------------------
    # Waiting callers of an exclusive lock stand in a line, in the order they first asked.
    # A release that finds the line non-empty wakes the first live one in it, in whichever
    # process it waits (the process's `wake_address`), and nobody else; with the line empty
    # it wakes as it did before. Each place is held for QUEUE_LEASE seconds from the holder's
    # last attempt, so a waiter that died without leaving holds the line up that long at most.
    def acquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        """`acquire` for a caller that waits its turn: a free lock is taken only by the first
        live waiter of the key's line, or by anyone while the line is empty. A refusal puts
        `owner` at the end of the line, or keeps its place, for QUEUE_LEASE seconds more,
        with this process's wake address; `retry_in` is then at most QUEUE_LEASE. Not queued
        when permits hold the key (`held_as` set). Taking the lock takes `owner` out of it.
        With `hands_off`, a release may have taken it already for `owner`: this returns that
        acquisition (its fence) and makes it live `ttl` from now."""
        raise NotImplementedError(f"{type(self).__name__} keeps no line of waiters")

    def leave_queue(self, key: str, owner: str) -> None:
        """Take `owner` out of `key`'s line (it stopped waiting); nothing if it is not in it.
        The next in line is woken if the lock is free. With `hands_off`, a lock handed over
        to `owner` meanwhile is released (and handed on): it stopped waiting, never took it.
        One it took up (any acquire of `owner`: a multi-key waiter takes a key of the line it
        stands in with `acquire_many`, then leaves the line) stays its own."""
        raise NotImplementedError(f"{type(self).__name__} keeps no line of waiters")

    # -- permits (stores with supports_modes) ---------------------------------------------
    # A permit is one holder of a shared lock or a semaphore, with its own owner, fence, ttl.
    # While any permit of a key lives, the key's lock is held by its GATE_OWNER, with the
    # latest permit's fence and the latest expiry of them all; the last permit to go frees it.
    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        """Take a permit of `key` in `mode`, with a fence greater than any this store gave
        `key` before, if the mode allows one more: shared unless an exclusive holder has it or
        a writer waits; a semaphore while fewer than `mode.limit` permits live. The same
        owner asking again gets its permit back, ttl renewed.

        With EXCLUSIVE (a writer that found readers): take the lock as `acquire` does; while
        shared permits hold it, mark `owner` as the writer waiting for it, for `writer_wait`
        seconds, so no new shared permit is given meanwhile.

        A refusal says how the key is held (`held_as`) and the seconds until the soonest
        holder's expiry (`retry_in`)."""
        raise NotImplementedError(f"{type(self).__name__} has no semaphores or shared locks")

    def release_permit(self, key: str, owner: str) -> bool:
        """Free `owner`'s permit of `key` if it still lives; True if it did. The last one
        frees the key."""
        raise NotImplementedError(f"{type(self).__name__} has no semaphores or shared locks")

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        """Make `owner`'s permit live at least `ttl` more seconds; False if it is gone."""
        raise NotImplementedError(f"{type(self).__name__} has no semaphores or shared locks")

    def holders(self, key: str) -> list[LockInfo]:
        """Every live holder of `key`, soonest expiry first: its lock, or each permit."""
        info = self.get(key)
        return [] if info is None else [info]

    def force_release(self, key: str, fence: int | None = None) -> LockInfo | None:
        """Free `key` whoever holds it (only the holder with `fence`, if given); the holder
        that was freed (with several permits, the first of them), or None if none (or another
        acquisition) was held.

        Reads the holders, then releases as each one's owner: a lock taken over in between is
        left alone, so what is reported is exactly what was freed.
        """
        for _ in range(3):
            chosen = [i for i in self.holders(key) if fence is None or i.fence == fence]
            if not chosen:
                return None
            freed = [info for info in chosen if self._release_holder(info)]
            if freed:
                return freed[0]
        return None

    def _release_holder(self, info: LockInfo) -> bool:
        if info.mode == "exclusive":
            return self.release(info.key, info.owner)
        return self.release_permit(info.key, info.owner)

    @abstractmethod
    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Stream the live holders whose key starts with `prefix`, in key order, without
        loading all at once: each lock, and each permit of a key held by permits."""

    def prune(self) -> int:
        """Delete expired entries the store keeps; how many. Stores that expire by themselves
        (`expires_by_itself`) return 0."""
        return 0

    # -- waiting --------------------------------------------------------------------------
    @property
    def push_wakeups(self) -> bool:
        """True while every release, in any process, reaches this process's waiters promptly;
        then a waiter needs to poll only for a holder that expires without releasing."""
        return False

    def watch(self, key: str, owner: str = "") -> Any:
        """Context manager yielding a `Waiter` for `key`; `owner`: the acquisition that
        waits, to which a wake-up may carry a grant (`WakeBoard.grant`). Stores with a
        cross-process listener start it here."""
        return self.wake_board.watch(key, owner)

    def watch_many(
        self, keys: Iterable[str], callback: Callable[[str], None], owner: str = ""
    ) -> Any:
        """Context manager: `callback(key)` (from any thread) on each release of any of `keys`
        while it lasts (async waiters, multi-key waiters; `owner` as `watch`'s). Stores with
        a cross-process listener start it here, as `watch` does."""
        return self.wake_board.watch_many(keys, callback, owner)

    def close(self) -> None:
        """Release connections and stop listeners; the store may be used again afterwards."""

    # -- system checks and the admin ------------------------------------------------------
    #: A note the admin's all-stores page shows above this store's locks (None: none).
    admin_note: str | None = None

    @property
    def table_database(self) -> str | None:
        """The DATABASES alias in whose lock table (the admin's changelist of the `Lock`
        model) this store's locks are rows; None for a store that keeps them elsewhere."""
        return None

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        """`manage.py check`'s messages about this store's OPTIONS under `alias` (known to be
        a dict of known option names), from the settings alone: never connect."""
        return []

    @classmethod
    def check_servers(
        cls, stores: Mapping[str, Mapping[str, Any]], *, databases: Sequence[str]
    ) -> list[CheckMessage]:
        """The messages of a check tagged `database` (`check --database`, `migrate`) about
        the servers of `stores` (alias -> OPTIONS: every configured store of this class, or
        of a subclass that keeps this check), the command asking for `databases`."""
        return []

    # -- worker threads -------------------------------------------------------------------
    #: Threads that run sync operations for async callers and the watchdog (the size of
    #: asyncio's default executor).
    worker_threads = min(32, (os.cpu_count() or 1) + 4)
    _executor: ThreadPoolExecutor | None = None
    _executor_pid = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on this store's own worker threads, made once per process, in the
        caller's context (contextvars): an async acquire's store call runs under its span, so
        an instrumented driver's CLIENT spans nest under it there too.

        Not asyncio's executor: that one lives and dies with each event loop, and a connection
        a store opens per thread would outlive its thread; these threads live as long as the
        store, so the connections they open stay few and are reused.
        """
        executor = self._executor
        if executor is None or self._executor_pid != os.getpid():
            with _executor_mutex:
                executor = self._executor
                if executor is None or self._executor_pid != os.getpid():
                    executor = self._executor = ThreadPoolExecutor(
                        self.worker_threads, thread_name_prefix=f"keel-lock-{self.alias}"
                    )
                    self._executor_pid = os.getpid()
        return executor.submit(contextvars.copy_context().run, fn, *args)

    # -- async ----------------------------------------------------------------------------
    # Defaults run the sync operation on the store's worker threads; stores with a native
    # async client (Redis) override them. The core makes them cancellation-safe, not the store.
    async def aacquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return await asyncio.wrap_future(self.submit(self.acquire, key, owner, holder, ttl))

    async def arelease(self, key: str, owner: str) -> bool:
        return await asyncio.wrap_future(self.submit(self.release, key, owner))

    async def aextend(self, key: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(self.submit(self.extend, key, owner, ttl))

    async def aget(self, key: str) -> LockInfo | None:
        return await asyncio.wrap_future(self.submit(self.get, key))

    async def aacquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        return await asyncio.wrap_future(self.submit(self.acquire_many, keys, owner, holder, ttl))

    async def arelease_many(self, keys: tuple[str, ...], owner: str) -> bool:
        return await asyncio.wrap_future(self.submit(self.release_many, keys, owner))

    async def aextend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(self.submit(self.extend_many, keys, owner, ttl))

    async def aacquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return await asyncio.wrap_future(self.submit(self.acquire_queued, key, owner, holder, ttl))

    async def aleave_queue(self, key: str, owner: str) -> None:
        await asyncio.wrap_future(self.submit(self.leave_queue, key, owner))

    async def aacquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        return await asyncio.wrap_future(
            self.submit(self.acquire_permit, key, owner, holder, ttl, mode, writer_wait)
        )

    async def arelease_permit(self, key: str, owner: str) -> bool:
        return await asyncio.wrap_future(self.submit(self.release_permit, key, owner))

    async def aextend_permit(self, key: str, owner: str, ttl: float) -> bool:
        return await asyncio.wrap_future(self.submit(self.extend_permit, key, owner, ttl))

    async def aholders(self, key: str) -> list[LockInfo]:
        return await asyncio.wrap_future(self.submit(self.holders, key))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"
