"""Connection helpers the stores share: one connection per thread, a cheap staleness probe,
and deadlines for calls on a connection whose server stopped answering."""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from django.core.exceptions import ImproperlyConfigured

from ..durations import to_seconds

#: OPTIONS SOCKET_TIMEOUT of the server stores when it is left out: fail fast rather than hang a
#: request on a frozen server (redis-py before 8 and libpq wait for ever by default).
DEFAULT_SOCKET_TIMEOUT = 5.0


def socket_timeout_option(alias: str, options: Mapping[str, Any]) -> float:
    """OPTIONS SOCKET_TIMEOUT of a server store, in seconds: the longest one store call waits
    on the network. A duration as `ttl` takes one (5, 0.5, "1500ms"); anything else is
    ImproperlyConfigured naming it. None is refused, not "no limit": waiting for ever is what
    the option prevents."""
    value = options.get("SOCKET_TIMEOUT", DEFAULT_SOCKET_TIMEOUT)
    try:
        return to_seconds(f"KEEL_LOCK_STORES[{alias!r}] OPTIONS SOCKET_TIMEOUT", value)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(str(exc)) from None


T = TypeVar("T")


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
    """Whether a socket has something to read, in one poll() (redis-py's can_read() makes
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


class Deadline:
    """How long the call in flight on one connection may wait for its server.

    `arm()` before the driver call and `disarm()` after it (whatever happened). A call still in
    flight when its time is up has its socket shut down by the process's `SocketDeadlines`
    thread: the driver, blocked reading, then sees the connection end and raises at once, and
    `disarm()` says so (True), for the caller to drop the connection.

    Why the socket is cut rather than the driver told: a server that has frozen (or a proxy in
    front of it) still has a live kernel that acknowledges every packet, so TCP's own limits
    (`tcp_user_timeout`, keepalives) never fire, and libpq has no limit of its own on how long
    a statement may wait. Arming costs a clock read and two attribute writes; the watching
    thread wakes about once per timeout while calls come, and sleeps when they stop.
    """

    __slots__ = ("__weakref__", "fileno", "fired", "mutex", "seconds", "until", "watch")

    def __init__(self, seconds: float, watch: SocketDeadlines | None = None) -> None:
        self.seconds = seconds
        self.watch = watch or SOCKET_DEADLINES
        self.fileno = -1
        self.until = 0.0  # monotonic; 0: nothing in flight
        self.fired = False
        self.mutex = threading.Lock()

    def attach(self, fileno: int) -> None:
        """Watch the socket `fileno` from now on (one connection's, for its whole life)."""
        self.fileno = fileno
        self.watch.register(self)

    def arm(self) -> None:
        if self.fileno < 0:
            return  # no socket (SQLite): nothing to wait for
        until = time.monotonic() + self.seconds
        self.until = until
        # Read after the write above: see SocketDeadlines._run for why that order matters.
        if until < self.watch.next_wake:
            self.watch.poke()

    def disarm(self) -> bool:
        """End the call's deadline; True if it passed and the socket was cut."""
        with self.mutex:  # never while the watcher is cutting: it must not cut the next call
            self.until = 0.0
            return self.fired

    def detach(self) -> None:
        """Before the connection is closed: its descriptor may be reused at once."""
        with self.mutex:
            self.until, self.fileno = 0.0, -1
        self.watch.unregister(self)

    def _expire(self, now: float) -> None:
        with self.mutex:
            if not (0.0 < self.until <= now) or self.fileno < 0:
                return
            self.until, self.fired = 0.0, True
            try:
                # A duplicate of the descriptor: shutdown() acts on the socket they share,
                # and closing the duplicate leaves the driver's descriptor to the driver.
                with socket.fromfd(self.fileno, socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already: the call is failing anyway


class SocketDeadlines:
    """The thread, one per process, that cuts the socket of every call past its `Deadline`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._deadlines: weakref.WeakSet[Deadline] = weakref.WeakSet()
        self._poked = threading.Event()
        self._thread: threading.Thread | None = None
        #: Monotonic time the thread looks next (inf: asleep until poked). A deadline armed
        #: for earlier pokes it.
        self.next_wake = math.inf

    def register(self, deadline: Deadline) -> None:
        with self._mutex:
            self._deadlines.add(deadline)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="keel-lock-deadlines", daemon=True
                )
                self._thread.start()

    def unregister(self, deadline: Deadline) -> None:
        with self._mutex:
            self._deadlines.discard(deadline)

    def poke(self) -> None:
        self._poked.set()

    def _run(self) -> None:
        while True:
            self._poked.clear()
            # Published before the deadlines are read: a call armed meanwhile either is seen
            # below or sees inf and pokes, so none is missed.
            self.next_wake = math.inf
            with self._mutex:
                deadlines = list(self._deadlines)
            now = time.monotonic()
            soonest = math.inf
            for deadline in deadlines:
                until = deadline.until
                if 0.0 < until <= now:
                    deadline._expire(now)
                elif until > 0.0:
                    soonest = min(soonest, until)
            self.next_wake = soonest
            self._poked.wait(None if soonest == math.inf else max(0.0, soonest - now))

    def after_fork(self) -> None:
        """In a forked child: the parent's connections are not the child's to cut (their
        sockets are shared with the parent), and the thread did not come along."""
        self._reset()


SOCKET_DEADLINES = SocketDeadlines()
os.register_at_fork(after_in_child=SOCKET_DEADLINES.after_fork)
