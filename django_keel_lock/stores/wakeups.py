"""Release wake-ups: the in-process board waiters sleep on, and the listener that feeds it
with other processes' releases (one loop; each store fills in how to talk to its server)."""

from __future__ import annotations

import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

logger = logging.getLogger("django_keel_lock")


class Waiter:
    """A registration for release wake-ups of one key, taken *before* an acquire attempt so that
    a release between the attempt and the wait is not missed."""

    __slots__ = ("_board", "_seen", "_slot")

    def __init__(self, slot: _Slot, board: WakeBoard) -> None:
        self._slot = slot
        self._board = board
        self._seen = slot.generation

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if a release of the key was announced meanwhile.
        Where the board has a `reader`, this thread reads the wake-up itself."""
        slot, seen, reader = self._slot, self._seen, self._board.reader
        if reader is not None and slot.generation == seen:
            began = time.monotonic()
            if reader(lambda: slot.generation != seen, timeout):
                timeout = 0.0
            else:  # it could not read, or stopped early (the listener gave up): what is left
                timeout = max(0.0, timeout - (time.monotonic() - began))
        with slot.lock:
            if slot.generation == self._seen:
                slot.sleepers += 1
                try:
                    slot.cond.wait(timeout)
                finally:  # the condition's lock held again
                    slot.sleepers -= 1
            woken = slot.generation != self._seen
            self._seen = slot.generation
            return woken

    def poll(self) -> bool:
        """True (once) if a release was announced since the last wait or poll; never blocks."""
        generation = self._slot.generation
        woken = generation != self._seen
        self._seen = generation
        return woken


class AnyWaiter:
    """A `Waiter` over several keys (a multi-key lock's): it hears the releases of each of
    them through the board's callbacks (`WakeBoard.watch_many`), registered before an
    attempt, and remembers which keys they were until its next wait ends."""

    __slots__ = ("_cond", "_woken")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._woken: set[str] = set()

    def wake(self, key: str) -> None:
        """A release of `key` was announced (called from any thread)."""
        with self._cond:
            self._woken.add(key)
            self._cond.notify_all()

    def wait(self, timeout: float, keys: Iterable[str] = ()) -> bool:
        """Block up to `timeout` seconds, until a release of one of `keys` (any key: none
        given) is announced or was since the last wait; True if one was."""
        wanted = set(keys)
        with self._cond:
            woken = self._cond.wait_for(
                lambda: bool(self._woken & wanted if wanted else self._woken), timeout
            )
            self._woken.clear()
            return woken


#: The most carried grants a key's slot keeps for owners still watching that have not taken
#: theirs (a grant whose owner stops watching is given back then); one pushed out past this
#: is dropped, not given back, and lasts up to its waiter's ttl.
GRANTS_KEPT = 16


class CappedFence(int):
    """The fence of a capped grant (`WakeBoard.grant`), which carries how long it is good
    for (seconds from its waiter's refused attempt) until a durable extend confirms it."""

    good_for: float


def capped(fence: int, good_for: float | None) -> int:
    """`fence`, or where `good_for` is given a `CappedFence` of it."""
    if good_for is None:
        return fence
    value = CappedFence(fence)
    value.good_for = good_for
    return value


class _Slot:
    __slots__ = (
        "callbacks",
        "cond",
        "generation",
        "grants",
        "lock",
        "owners",
        "sleepers",
        "watchers",
    )

    def __init__(self) -> None:
        # Held by entering `lock` itself: what entering the condition does, without its
        # Python-level __enter__ and __exit__ (a grant's way to its waiter takes it thrice).
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.generation = 0
        self.sleepers = 0  # the threads in cond.wait()
        self.watchers = 0
        self.callbacks: list[Any] = []
        self.grants: dict[str, int] = {}  # owner -> fence of the grant carried to it
        self.owners: dict[str, int] = {}  # the owners that wait here -> their watches


def _give_back(hook: Callable[[str, str, int], Any], key: str, owner: str, fence: int) -> None:
    """Run a store's give-back of a carried grant nobody here takes (`WakeBoard.give_back`):
    an error is logged, never raised (the grant then lapses at its waiter's ttl)."""
    try:
        hook(key, owner, fence)
    except Exception as exc:
        logger.warning(NOT_GIVEN_BACK, key, type(exc).__name__)


#: Logged when a carried grant nobody here takes cannot be given back.
NOT_GIVEN_BACK = (
    "lock %r was handed to a waiter that had gone and could not be given back (%s); it "
    "expires in the waiter's ttl"
)


class WakeBoard:
    """In-process release announcements, per key. A store calls `wake(key)` after its own
    releases and whenever its listener hears of a release by another process; `grant(key,
    owner, fence)` when what it heard is a release that handed the key over to `owner`, a
    waiter of this process, and carried the grant (see `grant`)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        #: The keys someone in this process listens to (read only): a release of another key
        #: need not call `wake`.
        self.watched: Mapping[str, object] = self._slots
        #: Called as hook(key, True) when a key gets its first watcher and hook(key, False)
        #: when its last one leaves (under the board's mutex: keep it short, never block).
        #: A listener uses it to hear only about the keys this process waits for.
        self.watched_hook: Callable[[str, bool], None] | None = None
        #: reader(done, timeout): a `Waiter` reads its wake-up itself, until done() or
        #: `timeout` seconds, instead of sleeping until the listener's thread wakes it; False
        #: when it cannot now (it then sleeps). Set by a store whose listener allows it
        #: (`ReleaseListener.read_here`).
        self.reader: Callable[[Callable[[], bool], float], bool] | None = None
        #: give_back(key, owner, fence): hand on a grant carried here that nobody takes (its
        #: owner waits for the key nowhere in this process, or stopped without taking it),
        #: acting only while that owner holds that grant untaken up. Set by a store that can
        #: (Redis's `give_back_grant`); run on a thread of its own, its errors logged.
        self.give_back: Callable[[str, str, int], Any] | None = None

    def _join(self, key: str, callback: Any = None, owner: str = "") -> _Slot:
        with self._mutex:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
                if self.watched_hook is not None:
                    self.watched_hook(key, True)
            slot.watchers += 1
            if callback is not None:
                slot.callbacks.append(callback)
            if owner:
                slot.owners[owner] = slot.owners.get(owner, 0) + 1
            return slot

    def _leave(self, key: str, slot: _Slot, callback: Any = None, owner: str = "") -> None:
        fence = None
        with self._mutex:
            if callback is not None:
                slot.callbacks.remove(callback)
            slot.watchers -= 1
            if owner:
                fence = self._unwait(slot, owner)
            if slot.watchers == 0 and self._slots.get(key) is slot:
                del self._slots[key]
                if self.watched_hook is not None:
                    self.watched_hook(key, False)
        if fence is not None:
            self._given_back(key, owner, fence)

    @staticmethod
    def _unwait(slot: _Slot, owner: str) -> int | None:
        """`owner` stops waiting at `slot` (under the board's mutex): the fence of a grant
        carried to it that it did not take, for `_leave` to give back (it stopped without
        leaving the line: its store failed, or its generator was closed; where it did leave
        the line, that passed the lock on, and the store's give-back is a no-op)."""
        left = slot.owners[owner] - 1
        if left:
            slot.owners[owner] = left
            return None
        del slot.owners[owner]
        if not slot.grants:
            return None
        with slot.lock:
            return slot.grants.pop(owner, None)

    def watch(self, key: str, owner: str = "") -> Watching:
        """A `Waiter` for `key` in the block; `owner`: the acquisition that waits, whose
        grants carried here are kept for it (`grant`) until the block ends."""
        return Watching(self, key, owner)

    def add_callback(self, key: str, callback: Any, owner: str = "") -> Any:
        """Call `callback()` (from any thread) on each wake of `key` while registered (for
        `owner`, as `watch`'s).

        Used by async waiters, which cannot block on a threading.Condition. Returns a token for
        `remove_callback`.
        """
        return (key, self._join(key, callback, owner), callback, owner)

    def remove_callback(self, token: Any) -> None:
        key, slot, callback, owner = token
        self._leave(key, slot, callback, owner)

    @contextmanager
    def watch_many(
        self, keys: Iterable[str], callback: Callable[[str], None], owner: str = ""
    ) -> Iterator[None]:
        """Call `callback(key)` (from any thread) on each wake of any of `keys` in the block
        (for `owner`, as `watch`'s)."""
        tokens = []
        try:
            for key in keys:
                tokens.append(self.add_callback(key, partial(callback, key), owner))
            yield
        finally:
            for token in tokens:
                self.remove_callback(token)

    def watched_keys(self) -> list[str]:
        with self._mutex:
            return list(self._slots)

    def has_watchers(self) -> bool:
        return bool(self._slots)

    def wake(self, key: str) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            self._wake_slot(slot)

    def grant(self, key: str, owner: str, fence: int, good_for: float | None = None) -> bool:
        """A release handed `key` over to `owner` with `fence`, at the owner's own ttl (its
        full ttl: what an `acquire_queued` of its would have given), and the store's wake-up
        carried the grant here: the waiter may become the holder without a store call.
        `good_for`: a capped grant, made before it was on disk (PostgreSQL, migration 0011),
        which its waiter believes for that many seconds (counted as its ttl is) until a
        durable extend of its confirms it; `take_grant` gives its fence as a `CappedFence`.
        Kept for the owner's waiter (`take_grant`), which is woken: True. False when `owner`
        waits for `key` nowhere in this process (`watch`), so nobody here can take it (its
        waiter stopped without leaving the line): it is given back (`give_back`), as it is
        when its waiter stops watching without taking it.

        A store may call this only when (1) the grant lives at least the owner's ttl from
        the moment it was made, and (2) it was made after the owner's last refused
        `acquire_queued` was answered, which reported the key's last fence
        (`AcquireResult.last_fence`) below `fence`: the waiter counts its lock from that
        attempt's send time, so it never believes in it longer than the store keeps it, and
        a grant message that arrives after a later refusal is recognised as stale. A waiter
        that does not take the grant (it stopped waiting meanwhile) leaves the line, which
        passes the lock on (`LockStore.leave_queue`), or, where it could not (its store
        failed), its grant is given back when it stops watching."""
        fence = capped(fence, good_for)
        with self._mutex:  # not into a slot its last watcher is leaving (`_leave`)
            slot = self._slots.get(key)
            kept = slot is not None and owner in slot.owners
            if slot is not None and kept:
                with slot.lock:  # kept, and its waiters woken, at once
                    grants = slot.grants
                    if fence > grants.get(owner, 0):
                        grants.pop(owner, None)  # last in: the one dropped first is the oldest
                        grants[owner] = fence
                        while len(grants) > GRANTS_KEPT:
                            del grants[next(iter(grants))]
                    callbacks = self._woken(slot)
        if slot is None or not kept:
            self._given_back(key, owner, fence)
            return False
        for callback in callbacks:
            callback()
        return True

    def granted(self, key: str, owner: str) -> int | None:
        """The fence of the grant of `key` carried to `owner` and not taken yet (a look:
        `take_grant` takes it)."""
        slot = self._slots.get(key)
        return None if slot is None else slot.grants.get(owner)

    def _given_back(self, key: str, owner: str, fence: int) -> None:
        """Give back a carried grant nobody here takes, on a thread of its own (the
        listener's loop or a waiter's way out must not wait for the store)."""
        hook = self.give_back
        if hook is not None:
            args = (hook, key, owner, fence)
            name = "keel-lock-give-back"
            try:
                threading.Thread(target=_give_back, args=args, name=name, daemon=True).start()
            except RuntimeError as error:  # the interpreter shuts down, or no thread is left
                logger.warning(NOT_GIVEN_BACK, key, type(error).__name__)

    def take_grant(self, key: str, owner: str) -> int | None:
        """The fence of the grant of `key` carried to `owner` (`grant`), once; None if none
        came (the waiter then asks the store)."""
        slot = self._slots.get(key)
        if slot is None or not slot.grants:
            return None
        with slot.lock:
            return slot.grants.pop(owner, None)

    def wake_all(self) -> None:
        """Wake every waiter: used when a listener reconnects and may have missed releases."""
        for slot in list(self._slots.values()):
            self._wake_slot(slot)

    @classmethod
    def _wake_slot(cls, slot: _Slot) -> None:
        with slot.lock:
            callbacks = cls._woken(slot)
        for callback in callbacks:
            callback()

    @staticmethod
    def _woken(slot: _Slot) -> list[Any]:
        """Wake the waiters of `slot` (under its lock): its callbacks, to call once out of
        every lock."""
        slot.generation += 1
        if slot.sleepers:  # (a Condition's notify_all is Python code, even for nobody)
            slot.cond.notify_all()
        return list(slot.callbacks) if slot.callbacks else []


class Watching:
    """`WakeBoard.watch`'s block: the key's slot joined on entering, left on leaving. A class
    and not a generator: leaving it is on the way from a grant to `acquire()` returning."""

    __slots__ = ("_board", "_key", "_owner", "_slot")

    def __init__(self, board: WakeBoard, key: str, owner: str) -> None:
        self._board, self._key, self._owner = board, key, owner

    def __enter__(self) -> Waiter:
        self._slot = self._board._join(self._key, None, self._owner)
        return Waiter(self._slot, self._board)

    def __exit__(self, *exc: object) -> None:
        self._board._leave(self._key, self._slot, None, self._owner)


class ReleaseListener:
    """One connection per process and store that hears other processes' releases and turns
    them into wake-ups on the store's WakeBoard.

    It listens only to the keys some thread or task of this process waits for: waiters ask
    through `want()`, which pokes its thread through a pipe so it (un)subscribes at once. Only
    that thread writes to its connection, and (re)connects it; where the store allows it
    (`reads_here`), a thread that waits for a key may read it meanwhile (`read_here`), so
    that the wake-up it waits for wakes it directly; whoever reads holds `_reading`. The loop
    (reconnect with backoff, wait on the socket and the pipe, settle subscriptions, keep the
    connection proven alive, the `ready` flag) is here; a store's listener fills in the
    hooks: `connect`, `prepare`, `socket`, `subscribe`, `unsubscribe`, `ping`, `dispatch`,
    `pending` and `disconnect`.

    It has a thread rather than being one: `threading.Thread` keeps private attributes whose
    names change between Python versions (3.13's `_handle` hid a subclass's method).
    """

    #: Quiet seconds (nothing read) after which the connection is pinged.
    ping_after = 5.0
    #: Quiet seconds after which the connection counts as dead (None: `ping()` raises instead).
    dead_after: float | None = None
    #: True when `subscribe`, `unsubscribe` and `ping` return only once the server answered:
    #: then a poke or a ping that went through proves the connection alive, as data does.
    replies_inline = False
    #: True when a thread waiting for a key may read the connection itself (`read_here`).
    reads_here = False
    #: What a read of the connection raises when it broke (`read_here` then gives up; any
    #: other exception, such as a task's time limit raised by a signal handler, goes on to
    #: end the wait).
    read_errors: tuple[type[Exception], ...] = (OSError, ValueError)
    #: Seconds within which this thread reads the connection again once a waiting thread
    #: stopped reading it (what arrives meanwhile waits that long at most).
    handed_back_within = 0.05
    #: Seconds a key stays subscribed after its last waiter left. A process that takes a key
    #: over and over waits for it again within moments: kept subscribed, it neither
    #: resubscribes each time nor has its waiters woken by each new subscription for a
    #: release that may have slipped by (an attempt that finds the lock held, as a rule).
    linger = 1.0

    def __init__(self, store: ListeningStore) -> None:
        self.thread = threading.Thread(
            target=self.run, name=f"keel-lock-listen-{store.alias}", daemon=True
        )
        self.store = store
        self.pid = os.getpid()
        self.ready = threading.Event()  # set while connected: releases reach us
        self.stopping = threading.Event()
        self.subscribed: set[str] = set()  # the keys subscribed on the current connection
        #: This process's wake address for the store's lines of waiters (see
        #: `LockStore.acquire_queued`): a store's listener also hears, from connecting on, the
        #: wake-ups sent to it, each naming its key.
        self.address = secrets.token_hex(8)
        self._mutex = threading.Lock()
        self._changed: set[str] = set()
        self._reading = threading.Lock()  # held by the thread reading the connection
        self._read_at = 0.0  # when a waiting thread last read something (monotonic)
        # A waiting thread's read ended by an exception of its own (a signal handler's): what
        # it had read off the socket may wait in the driver's buffer, where no poll sees it.
        self._unread = False
        self._lingering: dict[str, float] = {}  # subscribed, unwatched: key -> since (monotonic)
        self._closed = False
        self._poke_r, self._poke_w = os.pipe()
        # Written to have a waiting thread stop reading the connection (`stop_reader`).
        self._stop_r, self._stop_w = os.pipe()
        for end in (self._poke_r, self._poke_w, self._stop_r, self._stop_w):
            os.set_blocking(end, False)

    # -- the hooks --------------------------------------------------------------------------
    def connect(self) -> bool:
        """Open the connection; False when this store cannot hear releases at all (the
        listener then stops for good and waiters poll)."""
        raise NotImplementedError

    def prepare(self) -> bool:
        """Prepare the new connection, before any key is subscribed; True if releases reach
        us once the keys are subscribed, False if `connected()` is called later, when the
        server confirms."""
        raise NotImplementedError

    def socket(self) -> int:
        """The connection's descriptor; raises when the connection is gone."""
        raise NotImplementedError

    def subscribe(self, keys: list[str]) -> None:
        raise NotImplementedError

    def unsubscribe(self, keys: list[str]) -> None:
        raise NotImplementedError

    def ping(self) -> None:
        """Ask the server for a sign of life (raises when the connection is gone)."""
        raise NotImplementedError

    def dispatch(self, data: bool) -> None:
        """Read what arrived (`data`: the socket had something) and wake the released keys."""
        raise NotImplementedError

    def disconnect(self) -> None:
        raise NotImplementedError

    def pending(self) -> bool:
        """Whether something arrived that nobody has read yet (a waiting thread may have read
        what woke this thread: `read_here`). Only asked when `reads_here`, by this thread."""
        return True

    def hang_up(self) -> None:
        """End, at once, the read of a waiting thread that reads the connection (`read_here`):
        the connection is about to be given up. Only asked when `reads_here`."""

    # -- asked from other threads ---------------------------------------------------------
    def want(self, key: str, watched: bool) -> None:
        """`key` got its first waiter (or lost its last): (un)subscribe shortly."""
        with self._mutex:
            self._changed.add(key)
        if watched:  # a key left lingers anyway: no need to wake this thread for it now
            self.interrupt()

    def interrupt(self) -> None:
        """Wake the thread from `wait()`."""
        self._signal(self._poke_w)

    def _signal(self, end: int) -> None:
        """Write a byte to the pipe whose write end is `end` (the poke or the stop)."""
        with self._mutex:  # never write to a closed (and maybe reused) descriptor
            if self._closed:
                return
            try:
                os.write(end, b"x")
            except OSError:
                pass  # the pipe is full of bytes already

    def stop_reader(self) -> None:
        """Have a waiting thread that reads the connection (`read_here`) stop at once."""
        self._signal(self._stop_w)

    @contextmanager
    def excluding_readers(self) -> Iterator[None]:
        """The connection for this listener's thread alone in the block: a waiting thread
        that reads it (`read_here`) stops first. For a connection that cannot be read and
        written from two threads at once (libpq's): such a listener's statements run in one."""
        if not self._reading.acquire(blocking=False):
            self.stop_reader()
            self._reading.acquire()
        try:
            _drain(self._stop_r)  # no reader runs: what it was told does not outlive this
            yield
        finally:
            self._reading.release()

    def read_here(self, done: Callable[[], bool], timeout: float) -> bool:
        """Read the connection from a waiting thread until `done()` or `timeout` seconds: the
        wake-up it waits for then wakes it, not this listener's thread, which would have to
        wake it in turn (a second thread to schedule on a busy machine, the hand-off's
        last leg). False when it cannot (at once: the store does not allow it, the listener
        is not connected, or another thread reads) or stopped early (the connection broke,
        the listener gave it up, or its thread needs the connection: `stop_reader`): the
        caller sleeps what is left of `timeout`."""
        if not (self.reads_here and self.ready.is_set() and self.pid == os.getpid()):
            return False
        if not self._reading.acquire(blocking=False):
            return False
        if not self.ready.is_set():  # given up meanwhile (`_give_up`)
            self._reading.release()
            return False
        self.interrupt()  # so that this listener's thread stops reading the connection
        try:
            return self._read_until(done, timeout)
        except self.read_errors:  # the connection broke: the listener's thread reconnects
            return False
        except BaseException:  # raised in this thread (a signal handler's): mid-read, maybe
            self._unread = True
            raise
        finally:
            self._reading.release()
            if self._unread:
                self.interrupt()  # whoever reads next dispatches what was left

    def _read_unread(self) -> None:
        """Dispatch what an interrupted read left in the driver (holding `_reading`)."""
        if self._unread:
            self._unread = False
            self.dispatch(self.pending())

    def _read_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """`read_here`'s loop (holding `_reading`): False when told to stop."""
        poller = select.poll()
        poller.register(self.socket(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        deadline = time.monotonic() + timeout
        self._read_unread()
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = poller.poll(left * 1000)
            if any(fd == self._stop_r for fd, _ in ready):
                return False
            if ready:  # what poll() found is there: only the thread holding `_reading` reads
                self._read_at = time.monotonic()
                self.dispatch(True)
        return True

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

    # -- the loop ---------------------------------------------------------------------------
    def connected(self) -> None:
        """Releases reach us from now on."""
        self.ready.set()
        self.store.wake_board.wake_all()  # a release may have happened while we were (re)connecting

    def wait(self, fileno: int, timeout: float) -> tuple[bool, bool]:
        """Block until the connection `fileno` has data, or a poke came, or `timeout`:
        (data, poked)."""
        # poll(), not select(): select() fails for descriptors above 1024.
        poller = select.poll()
        if self._reading.locked():
            # A waiting thread reads the connection (`read_here`): this one, woken by what it
            # reads, would only compete with it. It looks again shortly: that thread stops
            # reading once it is woken.
            timeout = min(timeout, self.handed_back_within)
        else:
            poller.register(fileno, select.POLLIN)
        poller.register(self._poke_r, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(timeout * 1000)}
        return fileno in ready, self._poke_r in ready

    def take_changes(self) -> set[str]:
        """The keys whose waiting changed since the last call."""
        _drain(self._poke_r)
        with self._mutex:
            changed, self._changed = self._changed, set()
        return changed

    def settle(self, keys: set[str]) -> bool:
        """(Un)subscribe so that the watched ones among `keys` are subscribed, and the others
        not once they have lingered (`linger`); each new subscription wakes its key's waiters
        once (a release may have come just before). Whether it (un)subscribed any."""
        board, subscribed, lingering = self.store.wake_board, self.subscribed, self._lingering
        watched = set(board.watched_keys())
        now = time.monotonic()
        add = sorted(key for key in keys if key in watched and key not in subscribed)
        for key in keys:
            if key in watched:
                lingering.pop(key, None)
            elif key in subscribed:
                lingering.setdefault(key, now)
        drop = sorted(key for key, since in lingering.items() if now - since >= self.linger)
        if add:
            self.subscribe(add)
            subscribed.update(add)
            for key in add:
                board.wake(key)
        if drop:
            self.unsubscribe(drop)
            subscribed.difference_update(drop)
            for key in drop:
                del lingering[key]
        return bool(add or drop)

    def listen(self) -> None:
        """One connection's life: return only when `stopping` is set (or the store cannot
        hear releases); raise when the connection is lost."""
        if not self.connect():
            self.stopping.set()
            return
        try:
            self.subscribed = set()
            self._lingering = {}
            ready_now = self.prepare()
            self.take_changes()
            self.settle(set(self.store.wake_board.watched_keys()))
            if ready_now:
                self.connected()
            self._serve()
        finally:
            self.ready.clear()
            self._give_up()

    def _give_up(self) -> None:
        """Disconnect, once no waiting thread reads the connection (`read_here`): the store
        may give it back to a pool, and a thread still reading it would reopen it and read
        the replies of whoever gets it next. `hang_up` ends that thread's read now."""
        if not self.reads_here:
            self.disconnect()
            return
        self.hang_up()
        with self._reading:
            self.disconnect()
            _drain(self._stop_r)

    def _serve(self) -> None:
        heard = pinged = time.monotonic()
        while not self.stopping.is_set():
            data, poked = self.wait(self.socket(), 1.0)
            # A poke with nothing to (un)subscribe proves nothing: a waiting thread that
            # begins to read pokes too (`read_here`), and must not put the ping off.
            if poked or self._changed:
                said = self.settle(self.take_changes())
            else:  # drop the keys that have lingered long enough
                said = bool(self._lingering) and self.settle(set())
            now = time.monotonic()
            heard = max(heard, self._read_at)  # what a waiting thread read counts too
            if data or (said and self.replies_inline):
                heard = now
            elif self.dead_after is not None and now - heard > self.dead_after:
                # A silently dead link must not keep `ready` set.
                raise ConnectionError("no reply to PING on the release channel")
            elif now - heard > self.ping_after and now - pinged > self.ping_after:
                self.ping()
                pinged = now
                if self.replies_inline:
                    heard = time.monotonic()
            self._dispatch(data)

    def _dispatch(self, data: bool) -> None:
        """`dispatch` what arrived, unless a waiting thread reads it (`read_here`)."""
        if not self.reads_here or not (data or self._unread):
            self.dispatch(data)
        elif self._reading.acquire(blocking=False):
            try:
                self._read_unread()
                if data:
                    self.dispatch(self.pending())
            finally:
                self._reading.release()

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
                for end in (self._poke_r, self._poke_w, self._stop_r, self._stop_w):
                    os.close(end)


def _drain(fd: int) -> None:
    """Read a non-blocking pipe's end empty."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


class ListeningStore:
    """Mixin (before `LockStore` in the bases) for a store whose releases in other processes
    reach this one through a `ReleaseListener`: one per process, started by the first
    `watch()`, restarted in a forked child. The store names its `listener_class`."""

    alias: str
    wake_board: WakeBoard
    listener_class: type[ReleaseListener]
    _listener: ReleaseListener | None = None
    _listener_mutex = threading.Lock()

    def _listens(self) -> bool:
        """Whether this store can hear releases (checked on each `watch()`)."""
        return True

    @property
    def push_wakeups(self) -> bool:
        return self.listener_ready()

    def watch(self, key: str, owner: str = "") -> Any:
        if self._listens():
            self.ensure_listener()
        return self.wake_board.watch(key, owner)

    def watch_many(
        self, keys: Iterable[str], callback: Callable[[str], None], owner: str = ""
    ) -> Any:
        if self._listens():
            self.ensure_listener()
        return self.wake_board.watch_many(keys, callback, owner)

    def ensure_listener(self) -> None:
        """Start this process's listener unless one runs (a forked child starts its own)."""
        listener = self._listener
        if listener is not None and listener.usable_here:
            return
        with self._listener_mutex:
            listener = self._listener
            if listener is None or not listener.usable_here:
                self.wake_board.watched_hook = self._watched
                self.wake_board.reader = self._read_here
                self._listener = self.new_listener()
                self._listener.start()

    def new_listener(self) -> ReleaseListener:
        """A listener for this process: the store's `listener_class` unless it chooses."""
        return self.listener_class(self)

    def _read_here(self, done: Callable[[], bool], timeout: float) -> bool:
        listener = self._listener
        return listener is not None and listener.read_here(done, timeout)

    def _watched(self, key: str, watched: bool) -> None:
        listener = self._listener
        # A key left needs only that the listener is this process's (not a parent's, whose
        # mutex may have been held at the fork); one whose thread stopped is replaced by the
        # next watch, and the new one subscribes to the keys watched then.
        if listener is not None and (
            listener.usable_here if watched else listener.pid == os.getpid()
        ):
            listener.want(key, watched)

    def listener_ready(self) -> bool:
        """True while this process's listener hears releases (the `push_wakeups` answer)."""
        listener = self._listener
        return listener is not None and listener.ready.is_set() and listener.pid == os.getpid()

    @property
    def wake_address(self) -> str:
        """Where a release reaches this process's waiters in a key's line: its listener's
        address while it hears releases, else "" (they then find out by asking again)."""
        listener = self._listener
        return listener.address if listener is not None and self.listener_ready() else ""

    def stop_listener(self) -> None:
        with self._listener_mutex:
            listener, self._listener = self._listener, None
        if listener is not None and listener.pid == os.getpid():
            listener.stop()
