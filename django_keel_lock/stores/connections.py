"""Connection helpers the stores share: one connection per thread, and a cheap staleness probe."""

from __future__ import annotations

import os
import select
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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
