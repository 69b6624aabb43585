"""The Lock handle: how waiting, ownership, loss and fencing work.

Every surface (context manager, view decorator, management command, admin, Celery) goes
through `Lock`; stores below only answer atomic questions (see `stores.base.LockStore`).

What acquiring means (which store call, how long to pause, when to stand in line or give a
grant back) is decided once, in `engine`; `drivers` runs it with the store's sync calls or its
async ones. The async driver is cancellation-safe: a store call it starts always runs to its
end (`waiting.to_the_end`), so a cancellation never strands a lock nor skips a release. The
handle keeps what an acquisition is (owner, fence, valid-until) and tells signals and its
meter (`metrics.Meter`) what happened to it; `holding.Holding` is its part that releases,
extends, renews and loses an acquisition, `queries.KeyQueries` the questions about its key.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    NamedTuple,
    Protocol,
    Self,
    TypeVar,
    Unpack,
    cast,
    overload,
)

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.signals import setting_changed
from django.dispatch import Signal

from . import drivers, engine, metrics, signals, tokens, watchdog
from .durations import Duration, to_seconds
from .exceptions import LockError, LockNotHeldError, LockUnavailable
from .holding import Holding
from .options import (
    HandleOptions,
    LockOptions,
    LockSpec,
    OnLost,
    check_store,
    last_plain,
    lock_name,
    make_handles_with,
    refuse_option,
    validate_key,
    validate_keys,
)
from .queries import KeyQueries
from .registry import get_lock_store, on_stores_changed
from .stores.base import EXCLUSIVE, AcquireResult, LockInfo, LockStore, Mode
from .waiting import to_the_end

if TYPE_CHECKING:
    from .multi import MultiLock

__all__ = ["Lock", "LockOutcome", "force_release", "lock", "restore_lock", "semaphore"]

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")


def _announce(signal: Signal, **kwargs: Any) -> None:
    """Send one of our signals. A receiver that raises is logged (by Django, logger
    "django.dispatch"), not propagated: it must not strand an acquired lock nor cut a release
    short. Every acquire and release passes here: with no receivers it costs one test."""
    if signal.receivers:
        signal.send_robust(sender=Lock, **kwargs)


class Lock(Holding, KeyQueries):
    """A handle on one key in one store. Not shared between threads: make one per worker.

    A handle acquires at most once at a time; each acquisition gets a fresh random `owner`
    token and a `fence` strictly greater than every earlier fence of the key in that store.

    Its `mode` is exclusive (the default), shared (`shared=True`: any number of readers, and
    no writer meanwhile) or a semaphore (`limit=N`: at most N holders, each with a permit of
    its own). Same API and guarantees in every mode.
    """

    # Slots: a handle has more attributes than CPython keeps in a compact instance dict (30),
    # and past that every attribute read on the hot path costs more (0.3 µs a memory-store
    # cycle, 11 %). __weakref__: the watchdog refers to its handle weakly.
    __slots__ = (
        "__weakref__",
        "_attempts",
        "_meter",
        "_mutex",
        "_name",
        "_next_owner",
        "_raises",
        "_store",
        "auto_extend",
        "fence",
        "holder",
        "key",
        "max_hold",
        "mode",
        "on_lost",
        "owner",
        "plain",
        "retry_delay",
        "store_alias",
        "timeout",
        "ttl",
    )

    _next_owner: str | None
    _raises: bool
    _attempts: int

    def __init__(self, key: str, **options: Unpack[LockOptions]) -> None:
        """A handle on `key` taken as the `LockOptions` say (all of them: `limit` and
        `shared` too); nothing is acquired until acquire/run/`with`."""
        self._setup(key, LockSpec.of("Lock", options), label=None)

    @classmethod
    def from_spec(
        cls, key: str, spec: LockSpec, *, label: str | None = None, raises: bool = False
    ) -> Self:
        """A handle on `key` taken as `spec` says (what `LockSpec.lock` returns); `label`
        names the caller in the holder when the spec has none; `raises`: the caller raises
        LockUnavailable when the lock is not acquired (traces mark that refusal an error)."""
        handle = cls.__new__(cls)
        handle._setup(key, spec, label=label, raises=raises)
        return handle

    def _setup(
        self, key: str, spec: LockSpec, label: str | None = None, raises: bool = False
    ) -> None:
        last = _last_ready  # a change meanwhile replaces it: what is found then is not kept
        ready = last[0]
        if ready[0] is not spec:
            found = _ready.get(id(spec))
            ready = _prepare(spec) if found is None or found[0] is not spec else found
            last[0] = ready
        # The spec's options, as the handle keeps them: one unpacking.
        (
            _,
            self._store,
            longest,
            self.ttl,
            self.holder,
            self.timeout,
            self.retry_delay,
            self.auto_extend,
            self.max_hold,
            self.on_lost,
            self.store_alias,
            self.mode,
            self.plain,
            self._name,  # None: the key, normalised when first asked for (`name`)
        ) = ready
        if label is not None and spec.holder is None:
            self.holder = spec.holder_for(label)
        # `validate_key`'s tests, in short for the usual key: a printable str (printable, it
        # has no control character and no lone surrogate: it encodes as UTF-8).
        if (
            type(key) is str
            and key
            and key.isprintable()
            and (longest is None or len(key) <= longest)
        ):
            self.key = key
        else:
            self.key = validate_key(key, self._store)
        # A handle's state before its first acquire (`_FRESH`), in one unpacking.
        (
            self.owner,
            self._next_owner,
            self.fence,
            self.lost,
            self._lost_reason,
            self._body,
            self._held,
            self._valid_until,
            self._renewal,
            self._mutex,
            self._attempts,
            self._meter,
        ) = _FRESH
        if self.auto_extend:  # the state the watchdog shares with the handle's thread
            self._mutex = threading.Lock()
        # Whether a refusal raises (what the core tells metrics, with `_name`).
        self._raises = raises

    @property
    def _acquiring(self) -> object | None:
        """The mark of the acquire of this handle under way (`_begin`); None when none is."""
        return _acquires.get(self)

    @property
    def name(self) -> str:
        """What metrics and traces call this lock: the `name=` it was given (a surface's key
        template), else its key with digits, UUIDs and long hex as `*` (`options.lock_name`)."""
        if self._name is None:
            self._name = lock_name(self.key)
        return self._name

    # -- acquiring ------------------------------------------------------------------------
    def acquire(self, timeout: Duration | None = None, retry_delay: Duration | None = None) -> bool:
        """Take the lock, waiting up to `timeout` seconds (default: the handle's, 0 = no wait).

        True if acquired. Raises LockStoreUnavailable if the store cannot be reached.
        """
        if timeout is None and retry_delay is None:  # the handle's own: a call less
            wait, delay = self.timeout, self.retry_delay
        else:
            wait, delay = self._wait_args(timeout, retry_delay)
        # This acquire's mark on the handle (`_begin`): any new object (a list is made
        # without a call).
        mine: object = []
        try:
            owner, meter = self._begin(mine, wait)
            outcome = drivers.acquire(self, self._store, owner, wait, delay)
            return self._settle(owner, outcome, meter, wait, True)
        finally:
            if _acquires.get(self) is mine:  # not another acquire's, refused by _begin
                del _acquires[self]

    async def aacquire(
        self, timeout: Duration | None = None, retry_delay: Duration | None = None
    ) -> bool:
        """`acquire` for async code: waits without blocking the event loop.

        Cancelled while waiting or while an attempt is in flight, it leaves no lock behind,
        nor a place in the key's line of waiters."""
        wait, delay = self._wait_args(timeout, retry_delay)
        mine: object = []
        try:
            owner, meter = self._begin(mine, wait)
            outcome = await drivers.aacquire(self, owner, wait, delay)
            return self._settle(owner, outcome, meter, wait, False)
        finally:
            if _acquires.get(self) is mine:
                del _acquires[self]

    def _settle(
        self,
        owner: str,
        outcome: engine.Outcome,
        meter: metrics.Meter | None,
        wait: float,
        thread: bool,
    ) -> bool:
        """Take on what an acquire that could wait up to `wait` seconds came to
        (`drivers.acquire`), and tell its meter: the lock taken (the handle holds it,
        `lock_acquired`, its watchdog started in a `thread` or a task), refused (after waiting
        or not: `wait > 0`, worked out only then), or the error that ended it, raised again."""
        result, sent, self._attempts = outcome
        # An answer, or the error that ended the acquire (`type` first: a test cheaper than
        # isinstance passes the usual answer).
        if type(result) is not AcquireResult and isinstance(result, BaseException):
            if meter is not None:
                meter.failed(self, result, self._attempts)
            raise result
        fence = result[0]  # `fence` by index: by name, a slower lookup (CPython 3.11-3.13)
        if fence is None:
            logger.debug("lock %r is held by someone else", self.key)
            if meter is not None:
                meter.refused(self, wait > 0.0, self._attempts, self._raises)
            return False
        if not self.auto_extend:  # no other thread touches the handle: `_took` written out
            self.owner = owner
            self.fence = fence
            self._held = True
            self.lost = False
            self._next_owner = None
            self._valid_until = sent + self.ttl
        else:
            with self._mutex:  # the state the watchdog shares
                self._took(owner, fence, sent)
        good_for = result[6]  # a capped grant's: sure for that long, until confirmed
        if good_for is not None:
            self._cap(sent, good_for)
        if signals.lock_acquired.receivers:  # `_announce`'s test first: a call less
            _announce(signals.lock_acquired, lock=self)
        if meter is not None:
            meter.acquired(self, self._attempts, sent)
        if self.auto_extend or good_for is not None:  # a watchdog; or one confirming extend
            self._renewal = renewal = watchdog.Renewal(
                self, owner, sent, confirm=good_for is not None, once=not self.auto_extend
            )
            if not self.auto_extend:
                renewal.confirm()  # on the store's worker threads: no thread of its own
            elif thread:
                renewal.start_thread()
            else:
                renewal.start_task()
        return True

    def _cap(self, sent: float, good_for: float) -> None:
        """The lock came by a capped grant (`AcquireResult.good_for`): sure for `good_for`
        seconds from `sent` only, until the extend its renewal sends at once confirms it (the
        ttl then counts from that extend) or finds it gone (a crash of the store lost the
        grant: the lock is lost, before anyone else can have it). That renewal's thread
        shares the handle's state from here on: the handle gets a mutex if it had none."""
        if self._mutex is _UNSHARED:
            self._mutex = threading.Lock()
        with self._mutex:
            self._valid_until = min(self._valid_until, sent + good_for)

    def _took(self, owner: str, fence: int, sent: float) -> None:
        """The acquire of `owner` took the lock with `fence`: the handle holds it."""
        self.owner, self.fence, self._held, self.lost = owner, fence, True, False
        self._next_owner = None
        # The store started the ttl after we sent the call: counting from `sent` errs early.
        self._valid_until = sent + self.ttl

    def _wait_args(
        self, timeout: Duration | None, retry_delay: Duration | None
    ) -> tuple[float, float]:
        wait = self.timeout if timeout is None else to_seconds("timeout", timeout, allow_zero=True)
        delay = (
            self.retry_delay
            if retry_delay is None
            else to_seconds("retry_delay", retry_delay, allow_zero=True)
        )
        return wait, delay

    def _begin(self, mine: object, wait: float) -> tuple[str, metrics.Meter | None]:
        """The owner token for an acquire waiting up to `wait`, whose mark `mine` the handle
        then carries until the acquire clears it (in its `finally`, which starts before this
        call: an exception landing anywhere after the mark is set still clears it); and the
        acquire's meter (None while metrics are off: their only cost then)."""
        if self._held and time.monotonic() >= self._valid_until:
            # By its own clock the lock ran out: the handle holds nothing and may try again.
            self._lost("its ttl ran out without a confirmed extend", owner=self.owner)
        # Until this acquire ends, another acquire of the handle is refused: it would ask
        # with the same pending owner, and the store grants one owner twice. The mark is
        # claimed first (in one step, whatever thread or task asks), then `_held` read: an
        # acquire that took the lock set it before it gave the mark up.
        if _acquires.setdefault(self, mine) is not mine or self._held:
            raise LockError(self._busy_message())
        # The owner stays the same for every attempt until one succeeds: an attempt whose
        # reply was lost (timeout, dropped connection) may still have taken the lock, and a
        # retry with the same owner gets it back instead of stranding it until its ttl.
        owner = self._next_owner
        if owner is None:
            try:
                owner = _owners.pop()
            except IndexError:
                owner = _draw_owners()
            self._next_owner = owner
        if metrics.recorder is None:  # metrics are off: their only cost
            return owner, None
        self._meter = meter = metrics.begin(self, self._meter, wait)
        return owner, meter

    def _busy_message(self) -> str:
        """Why an acquire of this handle is refused while it holds or acquires its key."""
        if self._held:
            return (
                f"this handle already holds {self.key!r}; release it first or make a new handle "
                "(each task or thread needs its own handle: lock(...) per task)"
            )
        return (
            f"this handle is already acquiring {self.key!r} (in another task or thread); each "
            "task needs its own handle: lock(...) per task"
        )

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
        except BaseException as error:
            self._leave(error)
            raise
        self._leave(None)
        return LockOutcome(True, value)

    def run_immediately(self, fn: Callable[[], T]) -> LockOutcome[T]:
        """`run` that never waits: fn runs only if the lock is free right now."""
        return self.run(fn, timeout=0)

    # -- running, async ------------------------------------------------------------------
    @overload
    async def arun(  # type: ignore[overload-overlap]
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    @overload
    async def arun(
        self,
        fn: Callable[[], T],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[T]: ...

    async def arun(
        self,
        fn: Callable[[], Any],
        *,
        timeout: Duration | None = None,
        retry_delay: Duration | None = None,
    ) -> LockOutcome[Any]:
        """`run` for async code: `fn` is an async callable, or a sync one run in a thread.

        The release completes even on cancellation; a sync fn cannot be interrupted, so on
        cancellation the lock is kept until it returns, then released, then the cancel raised."""
        if not await self.aacquire(timeout=timeout, retry_delay=retry_delay):
            return LockOutcome(False, None)
        self._watch_body()
        try:
            value = await _call(fn)
        except BaseException as error:
            await self._aleave(error)
            raise
        await self._aleave(None)
        return LockOutcome(True, value)

    async def __aenter__(self) -> Self:
        raises, self._raises = self._raises, True  # a refusal here raises: traces say so
        try:
            acquired = await self.aacquire()
        finally:
            self._raises = raises
        if not acquired:
            raise self.unavailable()
        self._watch_body()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._aleave(exc)

    def unavailable(self, prefix: str = "") -> LockUnavailable:
        """The error saying this handle was not acquired in its timeout (after `prefix`,
        such as "report not run: "): every surface that raises it words it so."""
        if self.mode.kind == "semaphore":
            why = f"has no free permit (limit {self.mode.limit})"
        else:
            why = "is held by someone else"
        return LockUnavailable(
            self.key, f"{prefix}{self.describe()} {why} (waited {self.timeout:g}s)"
        )

    def describe(self) -> str:
        """ "lock 'key'", "shared lock 'key'" or "semaphore 'key'": for messages."""
        return f"{engine.kind_phrase(self.mode.kind, article=False)} {self.key!r}"

    def __enter__(self) -> Self:
        if metrics.recorder is None:  # only metrics read `_raises`: a swap less
            acquired = self.acquire()
        else:
            raises, self._raises = self._raises, True  # a refusal here raises: traces say so
            try:
                acquired = self.acquire()
            finally:
                self._raises = raises
        if not acquired:
            raise self.unavailable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()  # `_leave` written out: a call less per block
        if self.lost:
            self._check_kept(exc)

    # -- handing over ---------------------------------------------------------------------
    def serialize(self) -> str:
        """A signed token another process can pass to `restore_lock` to extend or release."""
        if self.owner is None or self.fence is None or not self._held:
            raise LockNotHeldError(f"cannot serialize {self.key!r}: this handle does not hold it")
        # The deadline travels as wall-clock time: monotonic clocks mean nothing in another
        # process. Clock skew between the two machines shifts it; the store stays the judge.
        expires_at = time.time() + (self._valid_until - time.monotonic())
        return tokens.dumps(self._token(self.owner, self.fence, expires_at))

    def _token(self, owner: str, fence: int, expires_at: float) -> tokens.Token:
        """What `serialize` signs of the acquisition it describes."""
        mode = self.mode
        return tokens.Token(
            self.key,
            self.ttl,
            owner,
            fence,
            self.holder,
            self.store_alias,
            expires_at,
            None if mode is EXCLUSIVE else (mode.limit if mode.kind == "semaphore" else "shared"),
        )

    @classmethod
    def _restore(cls, data: tokens.Token) -> Self:
        """A handle on what the token `data` describes (`restore_lock`), holding nothing yet."""
        mode = data.mode
        return cls(
            data.key,
            ttl=data.ttl,
            store=data.store,
            holder=data.holder,
            limit=mode if isinstance(mode, int) else None,
            shared=mode == "shared",
        )

    _announce = staticmethod(_announce)  # `Holding`'s: the sender is this class

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "not held"
        mode = "" if self.mode is EXCLUSIVE else f" {self.mode}"
        return f"<Lock {self.key!r}{mode} store={self.store_alias!r} {state}>"


make_handles_with(Lock.from_spec)

#: Owner tokens drawn ahead: one os.urandom call per OWNERS_DRAWN acquires, not one each.
#: Each is 128 random bits, as secrets.token_hex(16) draws them; a forked child forgets its
#: parent's (it would take the same ones).
_owners: list[str] = []
OWNERS_DRAWN = 64


def _draw_owners() -> str:
    """A new owner token, and OWNERS_DRAWN - 1 more kept for the next acquires."""
    # Split in C at the spaces hex() puts between each 16 bytes: slicing them out one by one
    # in Python cost as much again as drawing them.
    drawn = os.urandom(16 * OWNERS_DRAWN).hex(" ", 16).split(" ")
    owner = drawn.pop()
    _owners.extend(drawn)
    return owner


os.register_at_fork(after_in_child=_owners.clear)

#: The mark of each acquire under way, by its handle (`Lock._begin`): `dict.setdefault`
#: claims a handle in one step, which a mutex per handle did at a lock made per handle and
#: two calls more. (A handle hashes and compares as itself, in C: nothing runs meanwhile.)
#: A forked child has no acquire under way (`_forget_acquires`).
_acquires: dict[Lock, object] = {}


def _forget_acquires() -> None:
    """In a forked child: no acquire is under way. A handle the parent was acquiring draws
    an owner of its own when the child acquires it: the parent's acquire goes on asking
    with the one it drew, and a store both share would grant that owner to the two."""
    for handle in _acquires:
        handle._next_owner = None
    _acquires.clear()


os.register_at_fork(after_in_child=_forget_acquires)
#: A handle's `_mutex` when it has no watchdog: nothing to guard.
_UNSHARED: AbstractContextManager[object] = nullcontext()
#: A handle's state before its first acquire (`Lock._setup`): no owner, no owner drawn for
#: the next acquire, no fence; not lost (the reason: ""); no async block's body to cancel
#: (on_lost="raise" with auto_extend cancels it when the watchdog finds the lock lost); not
#: held, valid until ever (monotonic: the last expiry the store confirmed); no watchdog's
#: renewal; a mutex for the state a watchdog shares (without one, no other thread touches
#: it: one acquire at a time, `_begin`; a lock made per handle would cost a tenth of a
#: memory-store cycle); no store calls made, no meter (the recorder's that saw the last
#: acquire). One tuple unpacked: fewer bytecodes than an assignment each.
_FRESH = (None, None, None, False, "", None, False, math.inf, None, _UNSHARED, 0, None)

#: What a handle of a spec starts from (`_prepare`), by the spec's id: the spec, its store,
#: the longest key the store takes (None: any, a test less), its ttl, the holder of a handle
#: without a label, and the spec's timeout, retry_delay, auto_extend, max_hold, on_lost,
#: store alias, mode, whether it is exclusive (a handle of it on one key is `plain`) and
#: its name.
_Ready = tuple[
    LockSpec,
    LockStore,
    int | None,
    float,
    str,
    float,
    float,
    bool,
    float | None,
    OnLost,
    str,
    Mode,
    bool,
    str | None,
]
_ready: dict[int, _Ready] = {}
#: The one of them the last handle started from, looked at first: the usual program makes
#: handle after handle of one spec, and `_ready.get(id(spec))` costs a fiftieth of a cycle.
#: A change replaces the list (at first: no spec's).
_last_ready: list[_Ready] = [cast(_Ready, (None,))]
#: The most specs `_ready` keeps (a program makes a few kinds of handle: a rare reset).
READY_KEPT = 256


def _prepare(spec: LockSpec) -> _Ready:
    """What every handle of `spec` starts from, found once: kept until a setting changes, a
    store is set on an alias or the settings' stores are rebuilt, or the process forks (the
    default holder names the process)."""
    kept = _ready  # replaced by a change meanwhile: what is found then is not kept
    store = get_lock_store(spec.store)
    if spec.mode is not EXCLUSIVE and not store.supports_modes:
        what = "limit=" if spec.mode.kind == "semaphore" else "shared=True"
        raise ValueError(
            f"{what} needs a store with semaphores and shared locks; store {spec.store!r} "
            f"({type(store).__name__}) has none"
        )
    ready = (
        spec,
        store,
        store.max_key_length,
        spec.resolved_ttl(),
        spec.holder_for(None),
        spec.timeout,
        spec.retry_delay,
        spec.auto_extend,
        spec.max_hold,
        spec.on_lost,
        spec.store,
        spec.mode,
        spec.mode is EXCLUSIVE,
        spec.name,
    )
    if len(kept) >= READY_KEPT:
        kept.clear()
    kept[id(spec)] = ready
    return ready


def _forget_ready(**kwargs: object) -> None:
    global _ready, _last_ready
    _ready = {}
    _last_ready = [cast(_Ready, (None,))]


on_stores_changed(_forget_ready)
setting_changed.connect(_forget_ready, dispatch_uid="django_keel_lock.core.ready")
os.register_at_fork(after_in_child=_forget_ready)


class MultiMaker(Protocol):
    """`multi.MultiLock`, as `lock()` and `restore_lock` make one."""

    @classmethod
    def of(cls, keys: object, shared: object, options: Mapping[str, object]) -> MultiLock: ...

    @classmethod
    def _restore(cls, data: tokens.Token) -> MultiLock: ...


#: `multi.MultiLock`, handed in as that module loads (`multi_locks_with`): it builds on this
#: module, which therefore does not import it.
_multi: list[type[MultiMaker]] = []


def multi_locks_with(maker: type[MultiMaker]) -> None:
    """Have `lock([...])` and `restore_lock` make multi-key handles with `maker`."""
    _multi[:] = [maker]


class LockOutcome(NamedTuple, Generic[T]):
    """What `Lock.run` did: `acquired` is False when fn was not called (then `value` is None)."""

    acquired: bool
    value: T | None


@overload
def lock(key: str, *, shared: bool = False, **options: Unpack[HandleOptions]) -> Lock: ...


@overload
def lock(
    key: list[str] | tuple[str, ...], *, shared: bool = False, **options: Unpack[HandleOptions]
) -> MultiLock: ...


def lock(
    key: str | list[str] | tuple[str, ...],
    *,
    shared: bool = False,
    **options: Unpack[HandleOptions],
) -> Lock:
    """A handle on `key` in `store`; nothing is acquired until acquire/run/`with`. It takes
    the `LockOptions` (see there what each means) but `limit` (that is `semaphore()`).

    A list or tuple of keys makes a `MultiLock`: one handle that takes all of them at once or
    none (see `multi.MultiLock`; exclusive only).

    `shared=True` makes it a shared (read) lock: any number of shared holders at once, no
    exclusive one meanwhile; an exclusive acquirer that waits keeps new shared ones out, so
    readers cannot starve it.

    `auto_extend=True` keeps the lock alive while held (extending every ttl/3), for at most
    `max_hold` seconds in all if given. `on_lost` says what happens when the lock is lost while
    held: "raise" (leaving `with`/`run` raises LockNotHeldError), "warn" (log only), or a
    callable `(lock) -> None` called once when the loss is found.

    `name` is what metrics and traces call the lock ("invoice" for "invoice:42"); without
    it they show the key with its digits, UUIDs and long hex as `*`."""
    if type(key) is not str:
        if isinstance(key, list | tuple):
            return _multi[0].of(key, shared, options)
        if isinstance(key, Iterable) and not isinstance(key, str | bytes):
            validate_keys(key)  # a set, a generator: raises, asking for a list or tuple
    if "limit" in options:
        raise refuse_option("lock", "limit", "for at most N holders use semaphore(key, limit=N)")
    # The options as given (a new handle per `with lock(key):` is the usual way: no copy).
    given: Mapping[str, object] = options if shared is False else {**options, "shared": shared}
    last = last_plain[0]  # `LockSpec.of`'s first test written out: a call less per handle
    spec = last[1] if given == last[0] else _spec_of("lock", given)
    handle = _new_handle(Lock)  # `Lock.from_spec` written out: a call less per handle
    handle._setup(key, spec)
    return handle


#: Looked up once, for `lock()`: each lookup of a class's method makes a bound one.
_new_handle, _spec_of = Lock.__new__, LockSpec.of


def semaphore(key: str, *, limit: int, **options: Unpack[HandleOptions]) -> Lock:
    """A handle on the semaphore `key`: at most `limit` holders at once, each with a permit
    of its own (owner, fence, ttl), so one that crashes frees only its own place, at its ttl.

    The same API and `LockOptions` as `lock()` (`name` too), `limit` in place of `shared`.
    Each acquire counts the live permits against the `limit` it was given: every caller of
    one key should pass the same limit."""
    if limit is None:
        raise TypeError("semaphore() needs limit=, the most holders at once (an int >= 1)")
    if "shared" in options:
        raise refuse_option(
            "semaphore",
            "shared",
            "a semaphore's permits are alike; for readers and writers use lock(key, shared=True)",
        )
    return Lock.from_spec(key, LockSpec.parse("semaphore", limit=limit, **options))


async def _call(fn: Callable[[], Any]) -> Any:
    """Call `fn` from async code: await it if async, else run it in a worker thread.

    A thread cannot be interrupted: if cancelled meanwhile, wait for it, then re-raise."""
    if iscoroutinefunction(fn):
        return await fn()
    future, cancelled = await to_the_end(sync_to_async(fn, thread_sensitive=False)())
    if cancelled is not None:
        raise cancelled
    value = future.result()
    if inspect.isawaitable(value):  # lambda: some_coroutine(...)
        value = await value
    return value


def restore_lock(token: str) -> Lock:
    """The handle `Lock.serialize` described, holding the same acquisition (same owner, fence):
    a `Lock`, or a `MultiLock` when it describes one.

    Raises InvalidLockToken for garbage, truncated, tampered or foreign tokens.
    """
    data = tokens.loads(token)
    handle = (Lock if data.keys is None else _multi[0])._restore(data)
    handle.owner, handle.fence, handle._held = data.owner, data.fence, True
    # The lock lives as long as it had left when serialized, no longer (a token from before
    # tokens carried it: a whole ttl from now, as then).
    left = data.ttl if data.expires_at is None else data.expires_at - time.time()
    handle._valid_until = time.monotonic() + left
    return handle


def force_release(
    key: str, *, store: str = "default", user: object | None = None, fence: int | None = None
) -> LockInfo | None:
    """Free `key` in the store `store` whoever holds it; the lock that was freed, or None.
    With `fence`, only that acquisition: one taken over since (say, while a person was asked
    to confirm) is left alone.

    `manage.py locks release` and the admin both release through here: it logs a WARNING when
    it frees a lock and always sends `lock_force_released` (info=None: nothing was held).
    """
    lock_store = get_lock_store(check_store(store))
    validate_key(key, lock_store)
    info = lock_store.force_release(key, fence)
    if info is not None:
        logger.warning(
            "lock %r in store %r (holder %s, fence %s) was force-released by %s",
            key,
            store,
            info.holder,
            info.fence,
            user if user is not None else "a script",
        )
    recorder = metrics.recorder
    if info is not None and recorder is not None:
        held = None
        if info.acquired_at is not None:
            held = max(0.0, (datetime.now(UTC) - info.acquired_at).total_seconds())
        recorder.forced(store, lock_name(key), held)
    _announce(signals.lock_force_released, key=key, store=store, info=info, user=user)
    return info
