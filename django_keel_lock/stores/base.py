"""The LockStore protocol every store implements, and the in-process wake-up board they share.

A store is a dumb, atomic key/owner table with expiry: it never waits, never retries and never
decides policy. Waiting, ownership tokens and fencing rules live in `django_keel_lock.core`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, NamedTuple, TypeVar

from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")
_executor_mutex = threading.Lock()


@dataclass(frozen=True)
class LockInfo:
    """One held lock as a store sees it at the moment it was read."""

    key: str
    owner: str
    holder: str
    fence: int
    acquired_at: datetime | None
    expires_in: float  # seconds left, by the store's own clock


class AcquireResult(NamedTuple):
    """What one acquire attempt gave: a fence when acquired, else how long the holder has left."""

    fence: int | None
    retry_in: float | None = None  # seconds until the current holder's lock expires, if known

    @property
    def acquired(self) -> bool:
        return self.fence is not None


class Waiter:
    """A registration for release wake-ups of one key, taken *before* an acquire attempt so that
    a release between the attempt and the wait is not missed."""

    __slots__ = ("_seen", "_slot")

    def __init__(self, slot: _Slot) -> None:
        self._slot = slot
        self._seen = slot.generation

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if a release of the key was announced meanwhile."""
        slot = self._slot
        with slot.cond:
            if slot.generation == self._seen:
                slot.cond.wait(timeout)
            woken = slot.generation != self._seen
            self._seen = slot.generation
            return woken

    def poll(self) -> bool:
        """True (once) if a release was announced since the last wait or poll; never blocks."""
        generation = self._slot.generation
        woken = generation != self._seen
        self._seen = generation
        return woken


class _Slot:
    __slots__ = ("callbacks", "cond", "generation", "watchers")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.generation = 0
        self.watchers = 0
        self.callbacks: list[Any] = []


class WakeBoard:
    """In-process release announcements, per key. A store calls `wake(key)` after its own
    releases and whenever its listener hears of a release by another process."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        #: Called as hook(key, True) when a key gets its first watcher and hook(key, False)
        #: when its last one leaves (under the board's mutex: keep it short, never block).
        #: A listener uses it to hear only about the keys this process waits for.
        self.watched_hook: Callable[[str, bool], None] | None = None

    def _join(self, key: str, callback: Any = None) -> _Slot:
        with self._mutex:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
                if self.watched_hook is not None:
                    self.watched_hook(key, True)
            slot.watchers += 1
            if callback is not None:
                slot.callbacks.append(callback)
            return slot

    def _leave(self, key: str, slot: _Slot, callback: Any = None) -> None:
        with self._mutex:
            if callback is not None:
                slot.callbacks.remove(callback)
            slot.watchers -= 1
            if slot.watchers == 0 and self._slots.get(key) is slot:
                del self._slots[key]
                if self.watched_hook is not None:
                    self.watched_hook(key, False)

    @contextmanager
    def watch(self, key: str) -> Iterator[Waiter]:
        slot = self._join(key)
        try:
            yield Waiter(slot)
        finally:
            self._leave(key, slot)

    def add_callback(self, key: str, callback: Any) -> Any:
        """Call `callback()` (from any thread) on each wake of `key` while registered.

        Used by async waiters, which cannot block on a threading.Condition. Returns a token for
        `remove_callback`.
        """
        return (key, self._join(key, callback), callback)

    def remove_callback(self, token: Any) -> None:
        key, slot, callback = token
        self._leave(key, slot, callback)

    def watched_keys(self) -> list[str]:
        with self._mutex:
            return list(self._slots)

    def has_watchers(self) -> bool:
        return bool(self._slots)

    def wake(self, key: str) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            self._wake_slot(slot)

    def wake_all(self) -> None:
        """Wake every waiter: used when a listener reconnects and may have missed releases."""
        for slot in list(self._slots.values()):
            self._wake_slot(slot)

    @staticmethod
    def _wake_slot(slot: _Slot) -> None:
        with slot.cond:
            slot.generation += 1
            slot.cond.notify_all()
            callbacks = list(slot.callbacks)
        for callback in callbacks:
            callback()


class _Held(Generic[T]):
    __slots__ = ("__weakref__", "finalizer", "pid", "value")

    def __init__(self, value: T) -> None:
        self.value, self.pid = value, os.getpid()
        self.finalizer: Any = None


class PerThread(Generic[T]):
    """One resource (a connection) per thread, in the process that made it.

    A store opens a connection per thread so that no call waits for another thread's; this
    closes each when its thread ends (the thread-local goes, and with it the resource), drops
    one on request, and all of them on `close_all()`. A forked child never sees its parent's
    resources here and never closes them: the parent's sockets stay the parent's.
    """

    def __init__(self, close: Callable[[T], None]) -> None:
        self._close = close
        self._mutex = threading.Lock()
        self._local = threading.local()
        self._held: weakref.WeakSet[_Held[T]] = weakref.WeakSet()

    def get(self) -> T | None:
        held: _Held[T] | None = getattr(self._local, "held", None)
        if held is not None and held.pid == os.getpid():
            return held.value
        return None

    def put(self, value: T) -> T:
        """Make `value` this thread's resource."""
        held = _Held(value)
        held.finalizer = weakref.finalize(held, _close_in, self._close, value, held.pid)
        self._local.held = held
        with self._mutex:
            self._held.add(held)
        return value

    def drop(self) -> None:
        """Close this thread's resource (the next `get()` is None)."""
        held: _Held[T] | None = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None:
            with self._mutex:
                self._held.discard(held)
            held.finalizer()

    def close_all(self) -> None:
        with self._mutex:
            everything, self._held = list(self._held), weakref.WeakSet()
            self._local = threading.local()
        for held in everything:
            held.finalizer()


def _close_in(close: Callable[[T], None], value: T, pid: int) -> None:
    if pid != os.getpid():
        return
    try:
        close(value)
    except Exception:  # already broken: nothing more to free
        pass


class SocketCheck:
    """Whether a socket has something to read, in one poll() (redis-py's can_read() costs
    three system calls). Before a call on an idle connection, something to read means the
    server closed it (an error message or EOF waits): reconnect while nothing has been sent.
    Keeps its poll object while the descriptor stays the same."""

    __slots__ = ("fileno", "poller")

    def __init__(self) -> None:
        self.fileno = -1
        self.poller = select.poll()

    def readable(self, fileno: int) -> bool:
        if fileno != self.fileno:
            self.poller = select.poll()
            self.poller.register(fileno, select.POLLIN)
            self.fileno = fileno
        return bool(self.poller.poll(0))


class ReleaseListener:
    """One connection per process and store that hears other processes' releases and turns
    them into wake-ups on the store's WakeBoard.

    It listens only to the keys some thread or task of this process waits for: waiters ask
    through `want()`, which pokes its thread through a pipe so it (un)subscribes at once. Only
    that thread touches its connection. Subclasses implement `listen()`, using `wait()`,
    `take_changes()` and `settle()`.

    It has a thread rather than being one: `threading.Thread` keeps private attributes whose
    names change between Python versions (3.13's `_handle` hid a subclass's method).
    """

    def __init__(self, store: LockStore) -> None:
        self.thread = threading.Thread(
            target=self.run, name=f"keel-lock-listen-{store.alias}", daemon=True
        )
        self.store = store
        self.pid = os.getpid()
        self.ready = threading.Event()  # set while connected: releases reach us
        self.stopping = threading.Event()
        self._mutex = threading.Lock()
        self._changed: set[str] = set()
        self._closed = False
        self._poke_r, self._poke_w = os.pipe()
        os.set_blocking(self._poke_r, False)
        os.set_blocking(self._poke_w, False)

    def listen(self) -> None:
        """Connect, subscribe to the watched keys, set `ready`, call `store.wake_board.wake(key)`
        per release heard, and return only when `stopping` is set; raise when the connection is
        lost."""
        raise NotImplementedError

    # -- asked from other threads ---------------------------------------------------------
    def want(self, key: str, watched: bool) -> None:
        """`key` got its first waiter (or lost its last): (un)subscribe shortly."""
        with self._mutex:
            self._changed.add(key)
        self.interrupt()

    def interrupt(self) -> None:
        """Wake the thread from `wait()`."""
        with self._mutex:  # never write to a closed (and maybe reused) descriptor
            if self._closed:
                return
            try:
                os.write(self._poke_w, b"x")
            except OSError:
                pass  # the pipe is full of pokes already

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.interrupt()
        if self.thread.ident is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=3)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def usable_here(self) -> bool:
        return self.pid == os.getpid() and self.thread.is_alive()

    # -- for listen() -----------------------------------------------------------------------
    def wait(self, fileno: int, timeout: float) -> tuple[bool, bool]:
        """Block until the connection `fileno` has data, or a poke came, or `timeout`:
        (data, poked)."""
        # poll(), not select(): select() fails for descriptors above 1024.
        poller = select.poll()
        poller.register(fileno, select.POLLIN)
        poller.register(self._poke_r, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(timeout * 1000)}
        return fileno in ready, self._poke_r in ready

    def take_changes(self) -> set[str]:
        """The keys whose waiting changed since the last call."""
        try:
            while os.read(self._poke_r, 512):
                pass
        except BlockingIOError:
            pass
        with self._mutex:
            changed, self._changed = self._changed, set()
        return changed

    def settle(
        self,
        subscribed: set[str],
        keys: set[str],
        subscribe: Callable[[list[str]], None],
        unsubscribe: Callable[[list[str]], None],
    ) -> None:
        """(Un)subscribe so that exactly the watched ones among `keys` are subscribed; each new
        subscription wakes its key's waiters once (a release may have come just before)."""
        board = self.store.wake_board
        watched = set(board.watched_keys())
        add = sorted(key for key in keys if key in watched and key not in subscribed)
        drop = sorted(key for key in keys if key not in watched and key in subscribed)
        if add:
            subscribe(add)
            subscribed.update(add)
            for key in add:
                board.wake(key)
        if drop:
            unsubscribe(drop)
            subscribed.difference_update(drop)

    def run(self) -> None:
        backoff = 0.05
        try:
            while not self.stopping.is_set():
                try:
                    self.listen()
                    backoff = 0.05
                except Exception as exc:  # connection lost: waiters fall back to polling
                    self.ready.clear()
                    # Waiters sleeping on push must look again now: the store may be down
                    # (they should hear so) or releases may have been missed meanwhile.
                    self.store.wake_board.wake_all()
                    if self.stopping.is_set():
                        break
                    logger.debug("lock listener for %r reconnecting: %s", self.store.alias, exc)
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            self.ready.clear()
            with self._mutex:
                self._closed = True
                os.close(self._poke_r)
                os.close(self._poke_w)


class LockStore(ABC):
    """Where locks live. Every operation is atomic on the store's side and never waits.

    Times are seconds (float). Expiry is judged by the store's own clock, never the caller's.
    Any failure to reach the store raises `LockStoreUnavailable`, never a "not acquired".
    """

    #: Longest key this store accepts (None: no limit of its own).
    max_key_length: int | None = None
    #: Known options (upper-case names in KEEL_LOCK_STORES[alias]["OPTIONS"]).
    option_names: frozenset[str] = frozenset()
    #: True when the server itself deletes a lock once it expires (Redis key TTLs): `prune()`
    #: then has nothing to do, and `locks prune` says so rather than "pruned 0".
    expires_by_itself: bool = False

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        self.alias = alias
        self.options = dict(options or {})
        unknown = sorted(set(self.options) - self.option_names)
        if unknown:
            known = ", ".join(sorted(self.option_names)) or "none"
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS has unknown option(s) {', '.join(unknown)} "
                f"for {type(self).__name__} (known: {known})"
            )
        self.wake_board = WakeBoard()
        self.wake_board.watched_hook = self._watched

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

    def force_release(self, key: str, fence: int | None = None) -> LockInfo | None:
        """Free `key` whoever holds it (only the acquisition with `fence`, if given); the lock
        that was freed, or None if none (or another acquisition) was held.

        Reads the holder, then releases as that owner: a lock taken over in between is left
        alone, so what is reported is exactly what was freed.
        """
        for _ in range(3):
            info = self.get(key)
            if info is None or (fence is not None and info.fence != fence):
                return None
            if self.release(key, info.owner):
                return info
        return None

    @abstractmethod
    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        """Stream the live locks whose key starts with `prefix`, without loading all at once."""

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

    def watch(self, key: str) -> Any:
        """Context manager yielding a `Waiter` for `key`. Stores with a cross-process listener
        start it here."""
        return self.wake_board.watch(key)

    def close(self) -> None:
        """Release connections and stop listeners; the store may be used again afterwards."""

    # -- the cross-process listener, for stores that have one ------------------------------
    _listener: ReleaseListener | None = None
    _listener_mutex = threading.Lock()

    def ensure_listener(self, factory: Callable[[], ReleaseListener]) -> None:
        """Start this process's listener unless one runs (a forked child starts its own)."""
        listener = self._listener
        if listener is not None and listener.usable_here:
            return
        with self._listener_mutex:
            listener = self._listener
            if listener is None or not listener.usable_here:
                self._listener = factory()
                self._listener.start()

    def _watched(self, key: str, watched: bool) -> None:
        listener = self._listener
        if listener is not None and listener.usable_here:
            listener.want(key, watched)

    def listener_ready(self) -> bool:
        """True while this process's listener hears releases (the `push_wakeups` answer)."""
        listener = self._listener
        return listener is not None and listener.ready.is_set() and listener.pid == os.getpid()

    def stop_listener(self) -> None:
        with self._listener_mutex:
            listener, self._listener = self._listener, None
        if listener is not None and listener.pid == os.getpid():
            listener.stop()

    # -- worker threads -------------------------------------------------------------------
    #: Threads that run sync operations for async callers and the watchdog (the size of
    #: asyncio's default executor).
    worker_threads = min(32, (os.cpu_count() or 1) + 4)
    _executor: ThreadPoolExecutor | None = None
    _executor_pid = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on this store's own worker threads, made once per process.

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
        return executor.submit(fn, *args)

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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"
