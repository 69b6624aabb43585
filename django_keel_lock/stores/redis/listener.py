"""Redis's release listener: SUBSCRIBE to the release channels of the keys this process waits
for, on a redis-py connection whose replies are read off its socket and parsed here (`resp`),
without redis-py's PubSub object or parser (whose per-message bookkeeping and calls would sit
between a release arriving and its waiter being woken)."""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from ..connections import SocketCheck
from ..wakeups import ReleaseListener
from .clients import borrow_connection, pack_command, pubsub_pool
from .resp import Replies

if TYPE_CHECKING:
    from .store import RedisLockStore


class RedisListener(ReleaseListener):
    """One pub/sub connection per process, subscribed to the release channel of each key this
    process waits for, and to the store's base channel, which keeps the connection up and
    tells when it is. Commands go out without waiting for their replies: the connection counts
    as alive while something arrives, pinged after `ping_after` quiet seconds and given up after
    `dead_after`."""

    store: RedisLockStore
    ping_after = 5.0
    dead_after = 15.0
    reads_here = True
    read_errors = (OSError, ValueError, RedisError)
    _sock: Any = None  # the socket of the connection subscribed on (`prepare`)
    _replies: Replies  # what arrives on it

    def connect(self) -> bool:
        self._pool = pubsub_pool(self.store._client())
        self._conn = borrow_connection(self._pool)
        self._wake_channel = self.store.wake_prefix + self.address
        self._grant_channel = self._wake_channel + ":grant"
        # As they arrive (`_handle`).
        self._prefix = (self.store.channel + ":").encode()
        self._wake_bytes, self._grant_bytes = (
            self._wake_channel.encode(),
            self._grant_channel.encode(),
        )
        return True

    def prepare(self) -> bool:
        # The base channel last: once Redis confirms it, this process's wake and grant
        # channels are subscribed too (Redis answers a connection's commands in order).
        channels = (self._wake_channel, self._grant_channel, self.store.channel)
        # check_health=False, here and below: a pool's health check would PING and read the
        # reply itself, taking whatever message came first (and racing a waiting thread that
        # reads: `read_here`); the listener pings on its own (`ping_after`, `dead_after`).
        self._conn.send_packed_command([pack_command(b"SUBSCRIBE", *channels)], check_health=False)
        self._sock = getattr(self._conn, "_sock", None)  # the socket subscribed on
        # Read here from now on, never by redis-py: it read the replies of connecting
        # (AUTH, HELLO, SELECT) to their end, so nothing of ours is in its buffer.
        self._replies = Replies(self._sock)
        self._check = SocketCheck()
        return False  # ready once Redis confirms the base channel (see _handle)

    def _live(self) -> Any:
        """The connection, while its socket is the one subscribed on: redis-py closes a
        connection whose read fails (in a waiting thread that reads it: `read_here`) and
        reopens it on its next command or read, subscribed to nothing."""
        conn = self._conn
        if getattr(conn, "_sock", None) is None or conn._sock is not self._sock:
            raise ConnectionError("the pub/sub connection is closed")
        return conn

    def socket(self) -> int:
        # Every whole reply read so far was handled (`dispatch`), so anything new shows up on
        # the socket.
        return int(self._live()._sock.fileno())

    def subscribe(self, keys: list[str]) -> None:
        channels = map(self.store.release_channel, keys)
        self._live().send_packed_command(
            [pack_command(b"SUBSCRIBE", *channels)], check_health=False
        )

    def unsubscribe(self, keys: list[str]) -> None:
        channels = map(self.store.release_channel, keys)
        self._live().send_packed_command(
            [pack_command(b"UNSUBSCRIBE", *channels)], check_health=False
        )

    def ping(self) -> None:
        self._live().send_packed_command([pack_command(b"PING")], check_health=False)

    def dispatch(self, data: bool) -> None:
        if not data:
            return
        # Parsed before any waiter is woken: what arrived may be a grant carried to it, which
        # it must find when it wakes.
        self._live()
        try:
            for reply in self._replies.read():
                self._handle(reply)
        except BaseException:
            # Out of step with the server (ValueError, RedisError), or interrupted (a signal
            # handler's exception: a task's time limit, Ctrl-C) between taking replies off the
            # socket and handling them: start afresh, and the new connection wakes every key's
            # waiters to look again (`connected`) for what was read and not handled.
            self.hang_up()
            raise

    def pending(self) -> bool:
        sock = self._live()._sock
        if isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted, not read yet
            return True
        return self._check.readable(sock.fileno())

    def hang_up(self) -> None:
        sock = getattr(self._conn, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # the thread reading it hears the end at once
                sock.shutdown(socket.SHUT_RDWR)

    def disconnect(self) -> None:
        try:
            self._conn.disconnect()  # subscribed: unusable for anything else
            self._pool.release(self._conn)
        except Exception:
            pass

    def _handle(self, reply: Any) -> None:
        """One pub/sub reply (`resp.parse`'s, in bytes): [kind, channel, payload or count];
        anything else (a PONG) only proves the connection alive."""
        if type(reply) is not list or len(reply) < 3:
            return
        kind, channel, payload = reply[0], reply[1], reply[2]
        if kind == b"message":
            if channel == self._grant_bytes:  # first: what a waiter in line waits for
                self._grant(payload.decode("utf-8", "replace"))
            elif channel == self._wake_bytes:  # first in line for the key named
                self.store.wake_board.wake(payload.decode("utf-8", "replace"))
            elif channel.startswith(self._prefix):
                self.store.wake_board.wake(channel[len(self._prefix) :].decode("utf-8", "replace"))
        elif kind == b"subscribe":
            if channel in (self._wake_bytes, self._grant_bytes):
                pass
            elif channel.startswith(self._prefix):
                # Redis confirms: from now on the key's releases reach us. One may have come
                # just before, on another connection: its waiters look again.
                self.store.wake_board.wake(channel[len(self._prefix) :].decode("utf-8", "replace"))
            else:
                self.connected()

    def _grant(self, message: str) -> None:
        """A grant carried on this process's grant channel, "fence owner key"
        (`scripts.HAND_ON`): on to the board, which gives it back when nobody here waits as
        its owner (its waiter stopped without leaving the line: its last attempt failed), or
        the lock would be nobody's for the waiter's ttl (`RedisLockStore.give_back_grant`).
        Anything else is no grant (a message published there by hand)."""
        fence, _, rest = message.partition(" ")
        owner, _, key = rest.partition(" ")
        if fence.isascii() and fence.isdigit() and owner and key:
            self.store.wake_board.grant(key, owner, int(fence))
