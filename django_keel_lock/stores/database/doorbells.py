"""SQLite's release wake-ups across processes: doorbells beside the database file.

SQLite has no server to carry a release to the other processes, but they share one machine and
the file. A process that waits binds one Unix datagram socket, its bell, and for each key it
waits for hangs a symlink to it in the key's directory, `<db file>.keel-bells/<md5 of key>/`.
A release lists that directory and sends each bell the key's digest; the process's listener
reads it and wakes the key's waiters. A release nobody waits for costs one failed lstat.

A ring can be missed (a releaser that cannot reach the bell: another user's, a full queue),
so SQLite's waiters still poll every `retry_delay` (the store's `push_wakeups` stays False):
a ring only makes them look at once.

Releases and new waiters remove what dead processes left, so what they remove must never be
chosen by someone else: every directory is opened without following a symlink and used only
if it belongs to this process's user and nobody else may write into it (one made here is
0700; `UnsafeBellDirectory` otherwise, and waiters poll), everything in it is reached through
its descriptor, a link is read, never followed to be removed, and only a socket of this user
named as a bell, in such a directory, is ever removed.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
import weakref
from collections.abc import Iterator
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
_BELL_NAME = re.compile(r"[0-9]+-[0-9a-f]{8}")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_OPEN_DIRECTORY = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
#: What the doorbells need of the platform: Unix sockets, and directories used by descriptor.
_SUPPORTED = (
    hasattr(socket, "AF_UNIX")
    and bool(_O_NOFOLLOW and _O_DIRECTORY)
    and {os.open, os.mkdir, os.rmdir, os.unlink, os.readlink, os.symlink, os.stat, os.chmod}
    <= os.supports_dir_fd
    and os.listdir in os.supports_fd
)


class UnsafeBellDirectory(OSError):
    """A bell directory that is not this user's alone (a symlink, another user's, or one that
    others may write into): the doorbells do not use it, and waiters poll."""


def digest(key: str) -> bytes:
    """What names a key's directory (hex) and what its ring says (the 16 bytes)."""
    return hashlib.md5(key.encode("utf-8")).digest()


@contextlib.contextmanager
def _private_directory(path: str, dir_fd: int | None = None, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory `path` (relative to `dir_fd` if given; made with mode
    0700 if `create`), opened without following a symlink; raises UnsafeBellDirectory unless
    it belongs to this process's user and nobody else may write into it. One of ours that
    others may only read (made before the doorbells made theirs 0700) is made 0700."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(path, _OPEN_DIRECTORY, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EMLINK):  # EMLINK: the BSDs
            raise
        raise UnsafeBellDirectory(
            f"{path} is a symlink or not a directory; the doorbells use only a directory of "
            "their own: remove it (it is made again, mode 0700)",
        ) from exc
    try:
        _check_private(fd, path)
        yield fd
    finally:
        os.close(fd)


def _check_private(fd: int, path: str) -> None:
    found, uid = os.fstat(fd), os.geteuid()
    if found.st_uid != uid:
        raise UnsafeBellDirectory(
            f"{path} belongs to uid {found.st_uid}, not to this process's user (uid {uid}), "
            "and its owner could plant links in it: remove it (it is made again, mode 0700), "
            "or run every process that waits on this database as one user",
        )
    if found.st_mode & 0o022:
        raise UnsafeBellDirectory(
            f"{path} has mode {stat.S_IMODE(found.st_mode):04o}: other users may write into it "
            "and plant links: remove it (it is made again, mode 0700)",
        )
    if found.st_mode & 0o077:  # nobody else could write into it: ours to keep, made private
        os.fchmod(fd, 0o700)


class Doorbells:
    """The doorbells of one SQLite database file: `root` holds a directory per key waited for,
    of symlinks to the waiting processes' bells; the bells themselves are sockets in `root`
    too, or, where its path is too long for a socket's, in `socket_dir()` under the system's
    temporary directory. The symlinks say where each bell is, so a releaser never has to work
    that out."""

    def __init__(self, name: Any, root: str) -> None:
        self.name = name  # the database NAME this is for
        self.root = root
        self._sender: socket.socket | None = None

    @classmethod
    def of(cls, name: Any) -> Doorbells | None:
        """The doorbells of the SQLite database NAME `name`; None for an in-memory one (no
        other process can open it), or where there are no Unix sockets or directories to use
        by descriptor (Windows)."""
        if not _SUPPORTED:
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

    def socket_dir(self) -> str:
        """Where this process's bells are bound: `root`, or where its path is too long for a
        socket's, `keel-bells-<uid>-<tag of root>` in the temporary directory (a name anyone
        may take first: used only if it is ours alone, as `root` is)."""
        if len(os.fsencode(os.path.join(self.root, "x" * _NAME_MAX))) <= SUN_PATH_MAX:
            return self.root
        tag = hashlib.md5(os.fsencode(self.root)).hexdigest()[:16]
        return os.path.join(tempfile.gettempdir(), f"keel-bells-{os.geteuid()}-{tag}")

    # -- the releasing side ---------------------------------------------------------------
    def ring(self, key: str, skip: str | None = None) -> None:
        """Ring every bell hung for `key` (but `skip`, this process's own: its waiters know);
        remove the bells of processes that died. Never raises: a ring is only a hint."""
        key_digest = digest(key)
        try:
            os.lstat(self.key_dir(key_digest))  # nobody waits, as a rule: one failed call
            with (
                _private_directory(self.root) as root,
                _private_directory(key_digest.hex(), root) as directory,
            ):
                for name in os.listdir(directory):
                    if name != skip:
                        self._ring_one(key_digest, directory, name)
        except OSError:  # nobody waits (or not a directory to trust): nothing to ring
            return

    def _ring_one(self, key_digest: bytes, directory: int, name: str) -> None:
        try:
            bell = os.readlink(name, dir_fd=directory)  # not a link (EINVAL): left alone
            self._sending().sendto(key_digest, bell)
        except ConnectionRefusedError:  # its socket outlived its process (or is no socket)
            _unlink(name, directory)
            _remove_bell(bell)
        except FileNotFoundError:  # its bell is gone, or the entry just went
            _unlink(name, directory)
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
        """A new bell for this process: (its socket, non-blocking; its path; its name), a
        socket only its user may ring, in a directory of that user's alone."""
        with _private_directory(self.root, create=True):
            pass  # the keys' directories go there
        directory = self.socket_dir()
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        with _private_directory(directory, create=True) as fd:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                bell.bind(os.path.join(directory, name))
                if not _is_own_socket(name, fd):  # the path led elsewhere meanwhile
                    raise UnsafeBellDirectory(f"{directory} was replaced while a bell was bound")
                os.chmod(name, 0o600, dir_fd=fd)
                bell.setblocking(False)
            except BaseException:
                bell.close()
                raise
        return bell, os.path.join(directory, name), name

    def hang(self, key_digest: bytes, bell: str, name: str) -> None:
        """Hang the bell at path `bell` (named `name`) for the key of `key_digest`."""
        with _private_directory(self.root) as root:
            for _ in range(3):  # the last waiter elsewhere may remove the directory meanwhile
                try:
                    with _private_directory(key_digest.hex(), root, create=True) as directory:
                        os.symlink(bell, name, dir_fd=directory)
                    return
                except FileExistsError:
                    return
                except FileNotFoundError:
                    continue
        raise FileNotFoundError(f"{self.key_dir(key_digest)} keeps disappearing")

    def unhang(self, key_digest: bytes, name: str) -> None:
        with contextlib.suppress(OSError), _private_directory(self.root) as root:
            with contextlib.suppress(OSError), _private_directory(key_digest.hex(), root) as links:
                os.unlink(name, dir_fd=links)
            os.rmdir(key_digest.hex(), dir_fd=root)  # fails while others' bells hang there

    def sweep(self, skip: str, bells: str) -> None:
        """Remove the bells of processes that died without taking them down (os._exit in a
        forked worker, SIGKILL), from `root` and the directory `bells` this process's bell is
        in, and the symlinks to them; `skip` is our own bell's name."""
        for path in dict.fromkeys((self.root, bells)):
            with contextlib.suppress(OSError), _private_directory(path) as directory:
                for name in os.listdir(directory):
                    if name != skip:
                        _sweep_entry(path, directory, name, skip)


def _sweep_entry(path: str, directory: int, name: str, skip: str) -> None:
    """Sweep the entry `name` of the directory at `path` (open as `directory`): a key's
    directory of links, or a bell."""
    try:
        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        with contextlib.suppress(OSError), _private_directory(name, directory) as links:
            for link in os.listdir(links):
                if link != skip:
                    _sweep_link(links, link)
        with contextlib.suppress(OSError):  # still waited for
            os.rmdir(name, dir_fd=directory)
    elif stat.S_ISSOCK(mode) and not _answers(os.path.join(path, name)):
        _remove_socket(name, directory)


def _sweep_link(links: int, name: str) -> None:
    with contextlib.suppress(OSError):
        bell = os.readlink(name, dir_fd=links)  # not a link (EINVAL): left alone
        if not _answers(bell):
            _unlink(name, links)
            _remove_bell(bell)


def _answers(bell: str) -> bool:
    """Whether a process reads the bell at path `bell` (an empty ring, which it ignores)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.setblocking(False)
        probe.sendto(b"", bell)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # full, or not ours: let its own releases decide
    finally:
        probe.close()
    return True


def _is_own_socket(name: str, directory: int) -> bool:
    """Whether `name` in `directory` is itself (not through a link) a socket of this user's."""
    try:
        found = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISSOCK(found.st_mode) and found.st_uid == os.geteuid()


def _remove_socket(name: str, directory: int) -> None:
    """Remove the dead bell `name` of `directory`: only a socket of ours named as a bell."""
    if _BELL_NAME.fullmatch(name) and _is_own_socket(name, directory):
        _unlink(name, directory)


def _remove_bell(path: str) -> None:
    """Remove the dead bell at `path` (read from a link, so never trusted): only in a
    directory of ours alone, only a socket of ours named as a bell."""
    parent, name = os.path.split(path)
    with contextlib.suppress(OSError), _private_directory(parent) as directory:
        _remove_socket(name, directory)


def _unlink(name: str, directory: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=directory)


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
            logger.log(
                _level(exc), "lock store %r: no doorbells (%s): waiters poll", store.alias, exc
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
                logger.log(_level(exc), "lock store %r: no doorbell for %r: %s", alias, key, exc)

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
            _remove_bell(self._path)
        bell.close()


def _level(exc: OSError) -> int:
    """How loudly to log doorbells that cannot be used: a directory that is not ours alone is
    a misconfiguration or someone's attempt (warning); anything else is only a missed hint."""
    return logging.WARNING if isinstance(exc, UnsafeBellDirectory) else logging.DEBUG


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
