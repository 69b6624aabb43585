"""SQLite's release wake-ups across processes: doorbells beside the database file.

SQLite has no server to carry a release to the other processes, but they share one machine and
the file. A process that waits binds one Unix datagram socket, its bell, and for each key it
waits for hangs a symlink to it in the key's directory, `<db file>.keel-bells/<md5 of key>/`.
A release lists that directory and sends each bell the key's digest; the process's listener
reads it and wakes the key's waiters. A release nobody waits for costs one failed listdir.

A ring can be missed (a releaser that cannot reach the bell: another user's, a full queue),
so SQLite's waiters still poll every `retry_delay` (the store's `push_wakeups` stays False):
a ring only makes them look at once.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import stat
import tempfile
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ..wakeups import ReleaseListener

if TYPE_CHECKING:
    from .store import DatabaseLockStore

logger = logging.getLogger("django_keel_lock")

SUFFIX = ".keel-bells"
#: The longest socket path we bind: sun_path holds 108 bytes on Linux, 104 on macOS and the BSDs.
SUN_PATH_MAX = 100
_NAME_MAX = len("4194304-") + 8  # a bell's name: its pid (at most 7 digits) and 8 hex digits


def digest(key: str) -> bytes:
    """What names a key's directory (hex) and what its ring says (the 16 bytes)."""
    return hashlib.md5(key.encode("utf-8")).digest()


class Doorbells:
    """The doorbells of one SQLite database file: `root` holds a directory per key waited for,
    of symlinks to the waiting processes' bells; the bells themselves are sockets in `root`
    too, or, where its path is too long for a socket's, in a short directory under the
    system's temporary directory named after it. The symlinks say where each bell is, so a
    releaser never has to work that out."""

    def __init__(self, name: Any, root: str) -> None:
        self.name = name  # the database NAME this is for
        self.root = root
        self._sender: socket.socket | None = None

    @classmethod
    def of(cls, name: Any) -> Doorbells | None:
        """The doorbells of the SQLite database NAME `name`; None for an in-memory one (no
        other process can open it), or where there are no Unix sockets (Windows)."""
        if not hasattr(socket, "AF_UNIX"):
            return None
        path = os.fspath(name)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if path.startswith("file:"):  # Django opens NAME as a URI
            if "mode=memory" in path:
                return None
            path = unquote(urlsplit(path).path)
        if path in ("", ":memory:"):
            return None
        return cls(name, os.path.realpath(path) + SUFFIX)

    def key_dir(self, key_digest: bytes) -> str:
        return os.path.join(self.root, key_digest.hex())

    # -- the releasing side ---------------------------------------------------------------
    def ring(self, key: str, skip: str | None = None) -> None:
        """Ring every bell hung for `key` (but `skip`, this process's own: its waiters know);
        remove the bells of processes that died. Never raises: a ring is only a hint."""
        key_digest = digest(key)
        directory = self.key_dir(key_digest)
        try:
            names = os.listdir(directory)
        except OSError:  # nobody waits (or we may not look): nothing to ring
            return
        for name in names:
            if name != skip:
                self._ring_one(key_digest, os.path.join(directory, name))

    def _ring_one(self, key_digest: bytes, entry: str) -> None:
        try:
            bell = os.readlink(entry)
            self._sending().sendto(key_digest, bell)
        except ConnectionRefusedError:  # its socket outlived its process
            _remove(entry)
            _remove(bell)
        except FileNotFoundError:  # its bell is gone, or the entry just went
            _remove(entry)
        except OSError:  # full (the bell rings already), another user's, not ours to touch
            pass

    def _sending(self) -> socket.socket:
        sender = self._sender
        if sender is None:  # two threads may both make one: the spare is collected
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
            self._sender = sender
        return sender

    # -- the waiting side -----------------------------------------------------------------
    def bind(self) -> tuple[socket.socket, str, str]:
        """A new bell for this process: (its socket, non-blocking; its path; its name)."""
        os.makedirs(self.root, exist_ok=True)
        directory = self.root
        if len(os.fsencode(os.path.join(directory, "x" * _NAME_MAX))) > SUN_PATH_MAX:
            tag = hashlib.md5(os.fsencode(self.root)).hexdigest()[:16]
            directory = os.path.join(tempfile.gettempdir(), f"keel-bells-{tag}")
            os.makedirs(directory, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(directory, name)
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            bell.bind(path)
            bell.setblocking(False)
        except BaseException:
            bell.close()
            raise
        return bell, path, name

    def hang(self, key_digest: bytes, bell: str, name: str) -> None:
        """Hang the bell at path `bell` (named `name`) for the key of `key_digest`."""
        directory = self.key_dir(key_digest)
        for _ in range(3):  # the last waiter elsewhere may remove the directory meanwhile
            os.makedirs(directory, exist_ok=True)
            try:
                os.symlink(bell, os.path.join(directory, name))
                return
            except FileExistsError:
                return
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"{directory} keeps disappearing")

    def unhang(self, key_digest: bytes, name: str) -> None:
        directory = self.key_dir(key_digest)
        _remove(os.path.join(directory, name))
        with contextlib.suppress(OSError):  # others' bells hang there still
            os.rmdir(directory)

    def sweep(self, skip: str, bells: str) -> None:
        """Remove the bells of processes that died without taking them down (os._exit in a
        forked worker, SIGKILL), from `root` and the directory `bells` this process's bell is
        in, and the symlinks to them; `skip` is our own bell's name."""
        for directory in dict.fromkeys((self.root, bells)):
            for entry in _entries(directory):
                if entry.is_dir(follow_symlinks=False):
                    for link in _entries(entry.path):
                        if link.name != skip and link.is_symlink():
                            with contextlib.suppress(OSError):
                                if not _answers(os.readlink(link.path)):
                                    _remove(link.path)
                    with contextlib.suppress(OSError):  # still waited for
                        os.rmdir(entry.path)
                elif entry.name != skip and _is_socket(entry):
                    _answers(entry.path)


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as found:
            return list(found)
    except OSError:
        return []


def _is_socket(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return False


def _answers(bell: str) -> bool:
    """Whether a process reads the bell at path `bell` (an empty ring, which it ignores)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.setblocking(False)
        probe.sendto(b"", bell)
    except (ConnectionRefusedError, FileNotFoundError):
        _remove(bell)
        return False
    except OSError:
        return True  # full, or not ours: let its own releases decide
    finally:
        probe.close()
    return True


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class DoorbellListener(ReleaseListener):
    """This process's bell for one SQLite store: subscribing a key hangs it in the key's
    directory, each ring wakes the key's waiters. There is no connection to lose: the ping
    checks that the bell is still where it was bound (a cleaner of temporary files may
    remove it; the listener then binds a new one)."""

    store: DatabaseLockStore
    bells: Doorbells
    replies_inline = True  # the filesystem answers at once
    bell_name: str | None = None  # ours: a release by this process skips it
    _bell: socket.socket | None = None
    _path = ""
    _inode = 0

    def connect(self) -> bool:
        store = self.store
        bells = store.doorbells()
        if bells is None:
            store.push_possible = False
            return False
        try:
            self._bell, self._path, name = bells.bind()
            self._inode = os.stat(self._path).st_ino
        except OSError as exc:
            logger.debug(
                "lock store %r: no doorbells in %s (%s): waiters poll", store.alias, bells.root, exc
            )
            store.push_possible = False
            return False
        self.bells, self.bell_name = bells, name
        self._keys: dict[bytes, str] = {}
        _LISTENERS.add(self)
        bells.sweep(skip=name, bells=os.path.dirname(self._path))
        return True

    def prepare(self) -> bool:
        return True

    def socket(self) -> int:
        assert self._bell is not None
        return self._bell.fileno()

    def subscribe(self, keys: list[str]) -> None:
        assert self.bell_name is not None
        for key in keys:
            key_digest = digest(key)
            self._keys[key_digest] = key
            try:
                self.bells.hang(key_digest, self._path, self.bell_name)
            except OSError as exc:  # its waiters poll
                alias = self.store.alias
                logger.debug("lock store %r: no doorbell for %r: %s", alias, key, exc)

    def unsubscribe(self, keys: list[str]) -> None:
        assert self.bell_name is not None
        for key in keys:
            key_digest = digest(key)
            self._keys.pop(key_digest, None)
            self.bells.unhang(key_digest, self.bell_name)

    def ping(self) -> None:
        if os.stat(self._path).st_ino != self._inode:
            raise FileNotFoundError(f"the doorbell {self._path} was replaced")

    def dispatch(self, data: bool) -> None:
        if not data or self._bell is None:
            return
        board, keys = self.store.wake_board, self._keys
        while True:
            try:
                ring = self._bell.recv(64)
            except BlockingIOError:
                return
            key = keys.get(ring)
            if key is not None:
                board.wake(key)

    def disconnect(self) -> None:
        self.close(unhang=True)

    def close(self, unhang: bool) -> None:
        """Close the bell; `unhang`: take it and its symlinks down too (not in a forked
        child, where they are the parent's)."""
        bell, self._bell = self._bell, None
        if bell is None:
            return
        _LISTENERS.discard(self)
        if unhang and self.bell_name is not None:
            for key_digest in list(self._keys):
                self.bells.unhang(key_digest, self.bell_name)
            _remove(self._path)
        bell.close()


_LISTENERS: weakref.WeakSet[DoorbellListener] = weakref.WeakSet()


@atexit.register
def _take_bells_down() -> None:
    for listener in list(_LISTENERS):
        if listener.pid == os.getpid():
            listener.stop()  # its thread takes the bell down as it ends


def _forget_bells_in_child() -> None:
    # The parent's bells stay the parent's, but a child holding their sockets open would keep
    # a dead parent's bells answering, and its releases ringing into them.
    for listener in list(_LISTENERS):
        listener.close(unhang=False)


os.register_at_fork(after_in_child=_forget_bells_in_child)
