"""PostgreSQL's release listener: LISTEN on the channels of the keys this process waits for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections

from ..wakeups import ReleaseListener
from .dialects.postgresql import notify_channel

if TYPE_CHECKING:
    from .store import DatabaseLockStore

# libpq settings of the listener's connection: its ping, or keepalives while quiet, fail within
# about ten seconds on a link that died silently, not after TCP's ~15 minutes of
# retransmissions, in which waiters would trust wake-ups that never come.
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
    returns proves the connection alive, and a gone one raises."""

    store: DatabaseLockStore
    replies_inline = True
    fileno: int | None = None  # for inspection: the connection is this thread's alone
    _raw: Any = None

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
        self._keys_by_channel: dict[str, str] = {}
        return True

    def prepare(self) -> bool:
        self._raw.autocommit = True
        return True

    def socket(self) -> int:
        return int(self._raw.fileno())

    def subscribe(self, keys: list[str]) -> None:
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel[channel] = key
            self._raw.execute(f"LISTEN {channel}")  # returns once the server listens

    def unsubscribe(self, keys: list[str]) -> None:
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel.pop(channel, None)
            self._raw.execute(f"UNLISTEN {channel}")

    def ping(self) -> None:
        self._raw.execute("SELECT 1")

    def dispatch(self, data: bool) -> None:
        # Whatever `data` says: psycopg keeps what arrived while LISTEN/UNLISTEN ran.
        board, keys_by_channel = self.store.wake_board, self._keys_by_channel
        for notify in self._raw.notifies(timeout=0):
            key = keys_by_channel.get(notify.channel)
            if key is not None:
                board.wake(key)

    def disconnect(self) -> None:
        self._raw.close()
