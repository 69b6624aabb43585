"""PostgreSQL's release listener: LISTEN on the channels of the keys this process waits for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections

from ..connections import Deadline
from ..wakeups import ReleaseListener
from .dialects.postgresql import notify_channel

if TYPE_CHECKING:
    from .store import DatabaseLockStore

# libpq settings of the listener's connection: its ping, or keepalives while quiet, fail within
# about ten seconds on a link that died silently, not after TCP's ~15 minutes of
# retransmissions, in which waiters would trust wake-ups that never come. A server that froze
# keeps acknowledging packets, so these never fire for it: there the store's SOCKET_TIMEOUT
# bounds LISTEN, UNLISTEN and the ping (and connect_timeout the connecting).
LISTEN_TCP = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


class PostgresListener(ReleaseListener):
    """One LISTEN connection per process, listening to the channels of the keys this process
    waits for: turns other processes' releases into wake-ups. LISTEN, UNLISTEN and the ping
    (SELECT 1, after `ping_after` quiet seconds) wait for the server's answer, so each that
    returns proves the connection alive, and a gone one raises (or, if no reply comes within
    the store's SOCKET_TIMEOUT, has its socket cut and raises)."""

    store: DatabaseLockStore
    replies_inline = True
    fileno: int | None = None  # for inspection: the connection is this thread's alone
    _raw: Any = None
    _deadline: Deadline | None = None

    def connect(self) -> bool:
        store = self.store
        base = connections[store.database]
        wrapper = type(base)(store._connection_settings(), store.database)
        params = {**LISTEN_TCP, **wrapper.get_connection_params()}
        raw = wrapper.get_new_connection(params)
        self.fileno = raw.fileno()
        if not hasattr(raw, "notifies"):  # psycopg2: no push wake-ups, waiters poll
            raw.close()
            store.push_possible = False
            return False
        self._raw = raw
        self._deadline = Deadline(store.socket_timeout)
        self._deadline.attach(self.fileno)
        self._keys_by_channel: dict[str, str] = {}
        return True

    def _execute(self, sql: str) -> None:
        """Run `sql` and wait for its reply, SOCKET_TIMEOUT at most."""
        deadline = self._deadline
        assert deadline is not None
        deadline.arm()
        try:
            self._raw.execute(sql)
        finally:
            if deadline.disarm():
                raise ConnectionError(
                    f"no reply to {sql.split()[0]} within {deadline.seconds:g}s "
                    "(OPTIONS SOCKET_TIMEOUT)"
                )

    def prepare(self) -> bool:
        self._raw.autocommit = True
        return True

    def socket(self) -> int:
        return int(self._raw.fileno())

    def subscribe(self, keys: list[str]) -> None:
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel[channel] = key
            self._execute(f"LISTEN {channel}")  # returns once the server listens

    def unsubscribe(self, keys: list[str]) -> None:
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel.pop(channel, None)
            self._execute(f"UNLISTEN {channel}")

    def ping(self) -> None:
        self._execute("SELECT 1")

    def dispatch(self, data: bool) -> None:
        # Whatever `data` says: psycopg keeps what arrived while LISTEN/UNLISTEN ran.
        board, keys_by_channel = self.store.wake_board, self._keys_by_channel
        for notify in self._raw.notifies(timeout=0):
            key = keys_by_channel.get(notify.channel)
            if key is not None:
                board.wake(key)

    def disconnect(self) -> None:
        if self._deadline is not None:
            self._deadline.detach()  # first: the descriptor may be reused once closed
        self._raw.close()
