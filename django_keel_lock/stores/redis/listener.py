"""Redis's release listener: SUBSCRIBE to the release channels of the keys this process waits
for, on a connection read with redis-py's parser but without its PubSub object (whose
per-message bookkeeping — retries, handlers, dicts — would sit between a release arriving and
its waiter being woken)."""

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from ..wakeups import ReleaseListener
from .clients import as_text, borrow_connection, pack_command, pubsub_pool

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

    def connect(self) -> bool:
        self._pool = pubsub_pool(self.store._client())
        conn = self._conn = borrow_connection(self._pool)
        self._prefix = self.store.channel + ":"
        self._wake_channel = self.store.wake_prefix + self.address
        self._grant_channel = self._wake_channel + ":grant"
        # RESP3 delivers messages as pushes, which read_response() returns only when asked to
        # (older redis-py's Sentinel connections do not even take the argument).
        resp3 = str(getattr(conn, "protocol", 2)) == "3"
        self._read: dict[str, Any] = {"push_request": True} if resp3 else {}
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
        sock = self._live()._sock
        # Everything read so far was handled (dispatch drains redis-py's buffer), so anything
        # new shows up on the socket.
        return int(sock.fileno())

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
        conn = self._live()
        while True:
            self._handle(conn.read_response(**self._read))
            if not conn.can_read(timeout=0):
                break

    def pending(self) -> bool:
        return bool(self._live().can_read(timeout=0))

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
        """One pub/sub reply: [kind, channel, payload or count]; anything else (a PONG) only
        proves the connection alive."""
        if not isinstance(reply, list) or len(reply) < 2:
            return
        board, prefix = self.store.wake_board, self._prefix
        kind, channel = as_text(reply[0]), as_text(reply[1])
        if kind == "message" and channel.startswith(prefix):
            board.wake(channel[len(prefix) :])
        elif kind == "message" and channel == self._grant_channel and len(reply) > 2:
            self._grant(as_text(reply[2]))
        elif kind == "message" and channel == self._wake_channel and len(reply) > 2:
            board.wake(as_text(reply[2]))  # first in line for this key
        elif kind == "subscribe":
            if channel in (self._wake_channel, self._grant_channel):
                pass
            elif channel.startswith(prefix):
                # Redis confirms: from now on the key's releases reach us. One may have come
                # just before, on another connection: its waiters look again.
                board.wake(channel[len(prefix) :])
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
