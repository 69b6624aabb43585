"""Leader election: one process of many leads, the others wait to take over (`election()`).

    from django_keel_lock import election

    leader = election("scheduler", ttl="15s")
    with leader as term:          # campaign: blocks until this process leads
        run_the_scheduler(term)   # the term fences its writes; leaving the block resigns

A leader holds the lock `election:<name>` with the watchdog on (renewal is always on); its
**term** is that lock's fence, so terms strictly increase across leaders on every store.
Candidates wait in the key's line and are woken by the release, so a leader that resigns
(`resign()`, leaving the block, SIGTERM, interpreter exit) is replaced at once; one that dies
is replaced when its ttl runs out. Leadership lost while leading (a store that forgot it, a
process paused past its ttl) calls `on_lost(term)`, cancels an `async with` body and makes
leaving a `with` block raise LockNotHeldError, as for any lock.

`current()` reads who leads from the store, from any process: None when nobody does.
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from types import FrameType, TracebackType
from typing import Any, TypedDict, Unpack

from django.dispatch import receiver

from .core import Lock, lock
from .durations import Duration
from .exceptions import LockUnavailable
from .options import validate_key
from .registry import get_lock_store
from .signals import lock_lost
from .stores.base import LockInfo

#: The key of the lock an election's leader holds is this and the election's name.
KEY_PREFIX = "election:"
#: A campaign without a timeout waits in spells this long (one wait can not be unbounded).
SPELL = 3600.0
#: How long resigning at SIGTERM or exit may take before the process goes on ending.
EXIT_RESIGN_TIMEOUT = 2.0


@dataclass(frozen=True)
class Leader:
    """Who leads an election, as the store says: the holder's label, its term (the lock's
    fence) and when its term began (None where the store keeps no time)."""

    holder: str
    term: int
    since: datetime | None

    @classmethod
    def of(cls, info: LockInfo | None) -> Leader | None:
        return None if info is None else cls(info.holder, info.fence, info.acquired_at)


Callback = Callable[[int], object]


class Election:
    """One process's part in the election `name`: a candidate, the leader, or neither.

    Not shared between threads (as a lock handle is not): one per process and election."""

    def __init__(
        self,
        name: str,
        *,
        ttl: Duration | None = None,
        store: str = "default",
        holder: str | None = None,
        on_elected: Callback | None = None,
        on_lost: Callback | None = None,
    ) -> None:
        self.name = name
        self.key = validate_key(f"{KEY_PREFIX}{name}", get_lock_store(store))
        self.on_elected, self.on_lost = on_elected, on_lost
        self._options: dict[str, Any] = {"ttl": ttl, "store": store, "holder": holder}
        self._handle: Lock | None = None
        self._handle = self._new_handle(0)  # checks ttl, store and holder now

    def __repr__(self) -> str:
        return f"<Election {self.name!r} term={self.term} leading={self.is_leader()}>"

    @property
    def term(self) -> int | None:
        """This process's last term (None before it first led)."""
        return None if self._handle is None else self._handle.fence

    @property
    def ttl(self) -> float:
        """The ttl of the leader's lock, in seconds, as the store resolved it."""
        assert self._handle is not None
        return self._handle.ttl

    def confirmed_until(self) -> float:
        """While leading: the monotonic time until which the store confirmed this term (the
        watchdog's renewals push it out); past it another process may lead."""
        assert self._handle is not None
        return self._handle.confirmed_until()

    # -- campaigning ---------------------------------------------------------------------
    def campaign(self, timeout: Duration | None = None) -> int:
        """Wait until this process leads (`timeout` None: as long as it takes); the term.

        Already leading: the current term. A timeout that runs out raises LockUnavailable;
        a store that fails, LockStoreUnavailable."""
        if self.is_leader():
            return self._term()
        _resign_at_exit(self)
        for handle in self._candidates(timeout):
            if handle.acquire():
                return self._elected(handle)
        raise self._not_elected(timeout)

    async def acampaign(self, timeout: Duration | None = None) -> int:
        """`campaign` for async code."""
        if self.is_leader():
            return self._term()
        _resign_at_exit(self)
        for handle in self._candidates(timeout):
            if await handle.aacquire():
                return self._elected(handle)
        raise self._not_elected(timeout)

    def _candidates(self, timeout: Duration | None) -> Any:
        """Fresh handles to try in turn, each waiting one spell (one, if `timeout`)."""
        if timeout is not None:
            yield self._new_handle(timeout)
            return
        while True:
            yield self._new_handle(SPELL)

    def _new_handle(self, timeout: Duration) -> Lock:
        return lock(self.key, auto_extend=True, timeout=timeout, **self._options)

    def _elected(self, handle: Lock) -> int:
        self._handle = handle
        _elections[handle] = self
        term = self._term()
        if self.on_elected is not None:
            self.on_elected(term)
        return term

    def _term(self) -> int:
        assert self._handle is not None and self._handle.fence is not None
        return self._handle.fence

    def _not_elected(self, timeout: Duration | None) -> LockUnavailable:
        return LockUnavailable(
            self.key, f"election {self.name!r}: not elected within {timeout!r} (someone leads)"
        )

    # -- leading -------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """Whether this process leads, as far as it knows (no store round trip): elected,
        not resigned, not lost, its last renewal not run out."""
        return self._handle is not None and self._handle.held

    def resign(self) -> bool:
        """Stop leading, at once (a candidate in line takes over); True if this process led."""
        _leading.discard(self)
        handle = self._handle
        return handle is not None and handle.release()

    async def aresign(self) -> bool:
        _leading.discard(self)
        handle = self._handle
        return handle is not None and await handle.arelease()

    def current(self) -> Leader | None:
        """Who leads now, read from the store: None when nobody does."""
        return Leader.of(get_lock_store(self._options["store"]).get(self.key))

    async def acurrent(self) -> Leader | None:
        return Leader.of(await get_lock_store(self._options["store"]).aget(self.key))

    def _lost(self, handle: Lock) -> None:
        _leading.discard(self)
        if self.on_lost is not None and handle.fence is not None:
            self.on_lost(handle.fence)

    # -- blocks --------------------------------------------------------------------------
    def __enter__(self) -> int:
        _resign_at_exit(self)
        for handle in self._candidates(None):
            try:
                handle.__enter__()
            except LockUnavailable:
                continue
            return self._elected(handle)
        raise AssertionError("unreachable")  # pragma: no cover

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _leading.discard(self)
        if self._handle is not None:
            self._handle.__exit__(kind, exc, tb)

    async def __aenter__(self) -> int:
        _resign_at_exit(self)
        for handle in self._candidates(None):
            try:
                await handle.__aenter__()
            except LockUnavailable:
                continue
            return self._elected(handle)
        raise AssertionError("unreachable")  # pragma: no cover

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _leading.discard(self)
        if self._handle is not None:
            await self._handle.__aexit__(kind, exc, tb)


class ElectionOptions(TypedDict, total=False):
    """What `election()` takes besides the name (see `election`)."""

    ttl: Duration | None
    store: str
    holder: str | None
    on_elected: Callback | None
    on_lost: Callback | None


def election(name: str, **options: Unpack[ElectionOptions]) -> Election:
    """This process's part in the election `name` (see `Election`).

    `ttl`: how long a leader that died blocks the others (default KEEL_LOCK_DEFAULT_TTL);
    `store`: the alias (default "default"); `holder`: the label `current()` shows (default
    `<hostname>:<pid>`); `on_elected(term)`, `on_lost(term)`: called when this process becomes
    leader, and when it loses leadership without resigning (from the watchdog's thread, or
    its task for async leaders)."""
    return Election(name, **options)


# -- losing, resigning at exit -------------------------------------------------------------
#: The election each leader's handle belongs to (told of its loss by `lock_lost`).
_elections: weakref.WeakKeyDictionary[Lock, Election] = weakref.WeakKeyDictionary()
#: Elections that campaigned and have not resigned: resigned at SIGTERM and at exit.
_leading: weakref.WeakSet[Election] = weakref.WeakSet()
#: What `_resign_at_exit` has set up, once per process: "atexit", "sigterm".
_set_up: set[str] = set()
_set_up_mutex = threading.Lock()


@receiver(lock_lost)
def _on_lock_lost(lock: Lock, **kwargs: Any) -> None:
    found = _elections.get(lock)
    if found is not None:
        found._lost(lock)


def _resign_at_exit(leader: Election) -> None:
    """Resign `leader` when the interpreter exits, and at SIGTERM when nothing else handles
    it (the handler then ends the process by SIGTERM, as the default would have)."""
    _leading.add(leader)
    with _set_up_mutex:
        if "atexit" not in _set_up:  # from any thread: a worker thread's leader too
            _set_up.add("atexit")
            atexit.register(resign_all)
        # A handler can only be set from the main thread: the first campaign there does.
        if "sigterm" in _set_up or threading.current_thread() is not threading.main_thread():
            return
        _set_up.add("sigterm")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def resign_all() -> None:
    """Resign every election this process leads, each in a thread of its own, waiting at
    most EXIT_RESIGN_TIMEOUT: a store that does not answer must not keep a process from
    ending (its leadership then ends with its ttl)."""
    leaders = list(_leading)
    _leading.clear()
    threads = [threading.Thread(target=_quietly_resign, args=(each,)) for each in leaders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(EXIT_RESIGN_TIMEOUT)


def _quietly_resign(leader: Election) -> None:
    try:
        if leader._handle is not None:
            leader._handle.release()
    except Exception:  # ending anyway: the ttl frees it
        pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    resign_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


__all__ = ["Election", "Leader", "election", "resign_all"]
