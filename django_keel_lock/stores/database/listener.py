"""The release listeners of the database store: PostgreSQL's LISTENs on the channels of the keys
this process waits for; MariaDB's holds a slot of their doorbells and naps until rung. Each
also hears, from connecting on, the wake-ups sent to its wake address (`ReleaseListener.address`)
by a release whose line of waiters has this process's waiter first."""

from __future__ import annotations

import logging
import math
import secrets
import select
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from django.db import connections

from ..connections import Deadline
from ..wakeups import ReleaseListener
from .dialects.mysql import MySQLDialect
from .dialects.postgresql import (
    LISTENER_SQL,
    LISTENER_UNCLAIM_SQL,
    UNCAPPED_LISTENER_SQL,
    UNCAPPED_UNCLAIM_SQL,
    PostgresDialect,
    address_channel,
    grant_channel,
    notify_channel,
    read_grant,
)

if TYPE_CHECKING:
    from .store import DatabaseLockStore

logger = logging.getLogger("django_keel_lock")

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


#: How many times MariaDB's listener reads its process's grants when the read is interrupted
#: (`MariaDBListener._read_grants`): by another ring's KILL (1317), or by the server ending a
#: deadlock (1213: the read is the victim that wrote nothing). A read that waited its second
#: for a row lock (1205) is given up: the waiters find their grants by asking.
GRANT_READS = 3
GRANT_READ_RETRIES = frozenset({1317, 1213})
LOCK_WAIT_TIMEOUT = 1205


class PostgresListener(ReleaseListener):
    """One LISTEN connection per process, listening to the channels of the keys this process
    waits for: turns other processes' releases into wake-ups. It connects to the store's
    LISTEN_DATABASE if it has one (behind a transaction pooler), else to its DATABASE.
    LISTEN, UNLISTEN and the ping (SELECT 1, after `ping_after` quiet seconds) wait for the
    server's answer, so each that returns proves the connection alive, and a gone one raises
    (or, if no reply comes within the store's SOCKET_TIMEOUT, has its socket cut and
    raises).

    A thread waiting for a key reads the connection itself meanwhile (`reads_here`): the
    notification that hands it the lock wakes it, not this listener's thread. libpq allows one
    thread at a time on a connection, so each statement of the listener's first has that
    thread stop reading (`ReleaseListener.excluding_readers`). Notifications are read off
    libpq as they come (`dispatch`), or, when they arrive with a statement's reply, handed
    to `_heard` by psycopg (a notify handler: psycopg then keeps no backlog of them).

    While no key is subscribed the connection listens to nothing (it is "parked": UNLISTEN *,
    its advisory lock let go first): PostgreSQL signals every backend of the database that
    listens to anything at each NOTIFY, whatever the channel, and each wakes to read the
    queue; an idle process's listener would cost every contended release elsewhere its
    backend's wake (`bench.bench_idle_listeners`: beside 30 idle processes, one took three
    times as long). The first key subscribed LISTENs to the wake address's channels again,
    then takes the lock, in one round trip: a release carries a grant only while the lock is
    held, so never to a channel nobody listens on; a place written meanwhile gets the short
    grant and a wake-up, which the subscription's own wake of its key's waiters makes up
    for."""

    store: DatabaseLockStore
    replies_inline = True
    reads_here = True
    fileno: int | None = None  # for inspection: the connection is this thread's alone
    #: The server's pid of the connection while it listens: the places of this process's
    #: waiters name it, and a release carries them grants only while that connection holds
    #: its advisory lock (`LISTENER_SQL`), taken once it LISTENs.
    backend_pid: int | None = None
    #: True while it listens to nothing (no key subscribed; see the class).
    parked = True
    #: Whether it holds CAPPED_LOCK beside its own while it listens (capped grants).
    _capped = False
    _raw: Any = None
    _deadline: Deadline | None = None

    def connect(self) -> bool:
        store = self.store
        database = store.listen_database or store.database
        base = connections[database]
        wrapper = type(base)(store._connection_settings(database), database)
        params = {**LISTEN_TCP, **wrapper.get_connection_params()}
        raw = wrapper.get_new_connection(params)
        self.fileno = raw.fileno()
        if not hasattr(raw, "notifies"):  # psycopg2: no push wake-ups, waiters poll
            raw.close()
            store.push_possible = False
            return False
        raw.autocommit = True
        if not store.vendor.may_listen(raw):
            # Behind a transaction pooler a LISTEN would hear the releases of whichever
            # session the pooler lent: waiters poll (check W012 says what to set).
            raw.close()
            store.push_possible = False
            return False
        self._raw = raw
        self._deadline = Deadline(store.socket_timeout)
        self._deadline.attach(self.fileno)
        self._keys_by_channel: dict[str, str] = {}
        self._notes: deque[Any] = deque()  # taken off libpq, not heard yet (`dispatch`)
        # What a waiting thread's read raises when the connection broke (`read_here`).
        self.read_errors = (OSError, ValueError, raw.Error)
        raw.add_notify_handler(lambda notify: self._heard(notify.channel, notify.payload))
        return True

    def _execute(self, sql: str) -> Any:
        """Run `sql` and wait for its reply, SOCKET_TIMEOUT at most; its cursor."""
        deadline = self._deadline
        assert deadline is not None
        with self.excluding_readers():
            deadline.arm()
            try:
                return self._raw.execute(sql)
            finally:
                if deadline.disarm():
                    raise ConnectionError(
                        f"no reply to {sql.split()[0]} within {deadline.seconds:g}s "
                        "(OPTIONS SOCKET_TIMEOUT)"
                    )

    def prepare(self) -> bool:
        self._raw.autocommit = True
        self._encoding = self._raw.info.encoding
        self._address_channel = address_channel(self.address)
        self._grant_channel = grant_channel(self.address)
        self.backend_pid = int(self._execute("SELECT pg_backend_pid()").fetchone()[0])
        self.parked = True
        vendor = self.store.vendor  # before any key: whether this process takes capped grants
        if getattr(vendor, "capped_table", False) is None:
            found = self._execute(PostgresDialect.capped_table_sql).fetchone()[0]
            vendor.found_capped(bool(found))  # type: ignore[attr-defined]
        return True

    def socket(self) -> int:
        return int(self._raw.fileno())

    def subscribe(self, keys: list[str]) -> None:
        if keys and self.parked:
            # Listening first, then the lock (the order a release relies on), one round trip.
            # Capped grants only where this process's releases read them (`good_for`): else
            # one of its releases would put a capped grant on its board as a whole one.
            self._capped = self.store.capped_grants and self.store.capped_table is True
            claim = LISTENER_SQL if self._capped else UNCAPPED_LISTENER_SQL
            self._execute(f"LISTEN {self._address_channel}; LISTEN {self._grant_channel}; {claim}")
            self.parked = False
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel[channel] = key
            self._execute(f"LISTEN {channel}")  # returns once the server listens

    def unsubscribe(self, keys: list[str]) -> None:
        for key in keys:
            channel = notify_channel(key)
            self._keys_by_channel.pop(channel, None)
            if self._keys_by_channel or self.parked:
                self._execute(f"UNLISTEN {channel}")
        if not self._keys_by_channel and not self.parked:
            # The lock let go first: no release carries a grant to a channel about to go.
            self.parked = True
            unclaim = LISTENER_UNCLAIM_SQL if self._capped else UNCAPPED_UNCLAIM_SQL
            self._execute(f"{unclaim}; UNLISTEN *")

    def ping(self) -> None:
        self._execute("SELECT 1")

    def dispatch(self, data: bool) -> None:
        # Straight off libpq (never blocks: its socket is non-blocking), not psycopg's
        # notifies(), whose locking and waiting would sit between a grant arriving and its
        # waiter being woken. What arrived with a statement's reply went to `_heard` then.
        if not data:
            return
        # Taken off libpq first, each one let go once heard: a waiting thread's read that an
        # exception of its own ends midway (`read_here`) leaves the rest to whoever reads next.
        pgconn, encoding, notes = self._raw.pgconn, self._encoding, self._notes
        pgconn.consume_input()
        notes.extend(iter(pgconn.notifies, None))  # in C: no signal handler runs midway
        while notes:
            notify = notes[0]
            self._heard(notify.relname.decode(encoding), notify.extra.decode(encoding))
            notes.popleft()

    def _heard(self, channel: str, payload: str) -> None:
        """One notification: the wake-up or the grant it carries, on to the board."""
        board = self.store.wake_board
        if channel == self._address_channel:  # our waiter is first: its key
            board.wake(payload)
        elif channel == self._grant_channel:  # handed over, at its whole ttl
            try:
                grant = read_grant(payload)
            except ValueError:  # NOTIFYed by someone else: no release sends this
                logger.warning(
                    "lock listener for %r skipped a grant it cannot read", self.store.alias
                )
                return
            board.grant(*grant)
        else:
            key = self._keys_by_channel.get(channel)
            if key is not None:
                board.wake(key)

    def hang_up(self) -> None:
        self.stop_reader()

    def disconnect(self) -> None:
        self.backend_pid = None
        if self._deadline is not None:
            self._deadline.detach()  # first: the descriptor may be reused once closed
        self._raw.close()


class MariaDBListener(ReleaseListener):
    """One listener per process on MariaDB, which has no LISTEN: for each key this process
    waits for it holds a slot of the key's doorbell (see `MySQLDialect`) on its `sleeper`
    connection, which naps between its own statements (waits for a named lock that the
    listener's other connection, `control`, holds: see `MySQLDialect.nap_sql`). A release that
    someone waited for rings the doorbell: KILL QUERY ends the nap, the listener wakes the
    waiters of every key it listens to (a KILL does not say which key rang), and naps again.

    The sleeper also holds the named lock of this listener's wake address (`address_lock`): a
    release whose line of waiters has one of this process's first interrupts its nap alone.
    That release may have handed the lock over to the waiter for its whole ttl (while this
    listener held the address: see `MariaDB._grant`); a KILL carries nothing, so once one
    ends a nap the sleeper reads the grants of its process's places in the lines of the
    keys it listens to (`MySQLDialect.grants_sql`: one SELECT, after a shared lock of those
    keys' rows that waits for the release, which KILLs before its COMMIT, to end) and puts
    them on the board, where the waiter takes its grant with no call of its own
    (`WakeBoard.grant`). A grant this read misses (a KILL lost between two statements, a
    read given up) is taken up by the waiter's next attempt, which the next nap's wake
    brings at once.

    A KILL that reaches the sleeper between two statements does nothing, so a ring can be
    lost in the moment between two naps: each new nap is therefore followed by a wake of
    every key listened to. A lost ring costs its waiters at most one nap (`nap` seconds),
    never correctness; so does a key whose doorbell has no free slot (more than BELL_SLOTS
    processes wait for it), which is listened to without one.

    `control` also interrupts the nap when the listener needs the sleeper to (un)subscribe. Each
    nap's reply proves the sleeper alive: with none within `nap` + SOCKET_TIMEOUT the connection
    counts as dead (`ready` cleared: waiters poll) and is replaced; every other statement waits
    at most SOCKET_TIMEOUT (see `Deadline`).
    """

    store: DatabaseLockStore
    replies_inline = True
    #: Seconds one nap lasts: its reply is the ping (so `ping_after` never comes), and each
    #: new nap wakes the waiters once (the bound on a lost ring).
    nap = 5.0
    ping_after = math.inf
    connection_id: int | None = None  # the sleeper's: the store skips its own ring to it
    _napping = False

    @property
    def backend_pid(self) -> int | None:
        """The sleeper's connection id, which holds the wake address's lock: the places of
        this process's waiters name it, and a release carries them grants only while that
        connection holds the address (`MariaDB._grant`)."""
        return self.connection_id

    def connect(self) -> bool:
        store = self.store
        self._deadlines: list[Deadline] = []
        self._raws: list[Any] = []
        self._slots: dict[str, int | None] = {}
        self._napping = False
        self.dead_after = self.nap + store.socket_timeout
        try:
            self._sleeper, self._control = self._open(), self._open()
        except BaseException:
            self.disconnect()  # the one that opened, if any
            raise
        self.connection_id = int(self._sleeper[0].thread_id())
        # Its read of the grants waits for a release's row lock, which a release holds for
        # a few statements: not for InnoDB's default 50 s (`LOCK_WAIT_TIMEOUT`).
        self._call(self._sleeper, self.dialect.grants_lock_wait_sql)
        (taken,) = self._call(self._sleeper, self.dialect.anchor_sql, (self._address_lock(),))
        if taken != 1:
            # Still held by our connection before, which the server has not seen go (a link
            # that died silently): it may keep it for hours. Another address: the waiters'
            # places carry the new one from their next attempt on.
            self.address = secrets.token_hex(8)
            (taken,) = self._call(self._sleeper, self.dialect.anchor_sql, (self._address_lock(),))
            if taken != 1:
                raise ConnectionError("could not take a named lock for the wake address")
        anchor = self.dialect.anchor_name(int(self._control[0].thread_id()))
        self._nap = self.dialect.nap_sql.format(anchor=anchor, seconds=self.nap).encode()
        (taken,) = self._call(self._control, self.dialect.anchor_sql, (anchor,))
        if taken != 1:
            raise ConnectionError(f"could not take the listener's anchor {anchor!r}")
        return True

    def _address_lock(self) -> str:
        return self.dialect.address_lock(self.address)

    def _open(self) -> tuple[Any, Deadline]:
        store = self.store
        base = connections[store.database]
        wrapper = type(base)(store._connection_settings(), store.database)
        raw = wrapper.get_new_connection(wrapper.get_connection_params())
        self._raws.append(raw)
        deadline = Deadline(store.socket_timeout)
        deadline.attach(raw.fileno())
        self._deadlines.append(deadline)
        raw.autocommit(True)
        return raw, deadline

    def _call(self, conn: tuple[Any, Deadline], sql: str, params: Any = None) -> Any:
        """The first row of `sql` run on `conn`, waiting SOCKET_TIMEOUT at most."""
        raw, deadline = conn
        deadline.arm()
        try:
            cursor = raw.cursor()
            cursor.execute(sql, params)
            return cursor.fetchone()
        finally:
            self._disarm(deadline, sql)

    @staticmethod
    def _disarm(deadline: Deadline, sql: str) -> None:
        if deadline.disarm():
            raise ConnectionError(
                f"no reply to {sql.split()[0]} within {deadline.seconds:g}s "
                "(OPTIONS SOCKET_TIMEOUT)"
            )

    @property
    def dialect(self) -> MySQLDialect:
        dialect = self.store.dialect
        assert isinstance(dialect, MySQLDialect)
        return dialect

    def prepare(self) -> bool:
        return True

    def socket(self) -> int:
        return int(self._sleeper[0].fileno())

    def wait(self, fileno: int, timeout: float) -> tuple[bool, bool]:
        # Rings reach only a napping sleeper: nap before blocking.
        if not self._napping:
            self._sleeper[0].send_query(self._nap)
            self._napping = True
            board = self.store.wake_board
            for key in self.subscribed:  # a ring may have come since the last nap ended
                board.wake(key)
        return super().wait(fileno, timeout)

    def _end_nap(self) -> int | None:
        """Read the nap's reply: 0 if it ran out, None if it was interrupted."""
        raw, deadline = self._sleeper
        deadline.arm()
        try:
            raw.read_query_result()
            ((took,),) = raw.store_result().fetch_row()
        except raw.OperationalError as exc:
            if exc.args[0] != 1317:  # "query execution was interrupted": KILL QUERY
                raise
            took = None
        finally:
            self._napping = False
            self._disarm(deadline, "GET_LOCK")
        if took == 1:  # it would not nap again: the anchor is ours now
            raise ConnectionError("the listener's anchor was free: its control connection went")
        return None if took is None else int(took)

    def _halt(self) -> None:
        """Have the sleeper idle, to run a statement of ours. A KILL that reaches it before
        its nap began is lost, so it is sent again until the nap ends (SOCKET_TIMEOUT at
        most)."""
        if not self._napping:
            return
        poller = select.poll()
        poller.register(self._sleeper[0].fileno(), select.POLLIN)
        give_up = time.monotonic() + self.store.socket_timeout
        while True:
            self._call(self._control, self.dialect.kill_sql, (self.connection_id,))
            if poller.poll(20):  # the nap's reply came
                break
            if time.monotonic() > give_up:
                raise ConnectionError("the nap outlived KILL QUERY (OPTIONS SOCKET_TIMEOUT)")
        self._end_nap()

    def subscribe(self, keys: list[str]) -> None:
        self._halt()
        dialect = self.dialect
        for key in keys:
            (slot,) = self._call(self._sleeper, dialect.subscribe_sql, dialect.bell_names(key))
            self._slots[key] = slot
            if slot is None:
                logger.debug("every doorbell slot of %r is taken: its waiters poll once a nap", key)

    def unsubscribe(self, keys: list[str]) -> None:
        self._halt()
        dialect = self.dialect
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                name = dialect.bell_names(key)[slot]
                self._call(self._sleeper, dialect.unsubscribe_sql, (name,))

    def ping(self) -> None:
        self._halt()
        self._call(self._sleeper, "SELECT 1")

    def dispatch(self, data: bool) -> None:
        # Whoever rang, the next nap wakes every key listened to (see `wait`); a KILL may
        # have come from a release that handed a lock over to a waiter here: read the grants.
        if data and self._napping and self._end_nap() is None and self.subscribed:
            self._read_grants()

    def _read_grants(self) -> None:
        """Put the grants carried to this process's waiters on the board (see the class). A
        read interrupted (`GRANT_READ_RETRIES`) is made again; after a few, the waiters find
        their grants by asking (the next nap wakes them)."""
        keys = sorted(self.subscribed)
        marks = ", ".join(["%s"] * len(keys))
        wait, sql = self.dialect.grants_wait_sql, self.dialect.grants_sql
        raw, deadline = self._sleeper
        for _ in range(GRANT_READS):
            deadline.arm()
            try:
                cursor = raw.cursor()
                cursor.execute(wait.format(keys=marks), keys)
                cursor.execute(sql.format(keys=marks), (*keys, self.address))
                rows = cursor.fetchall()
                break
            except raw.OperationalError as exc:
                if exc.args[0] == LOCK_WAIT_TIMEOUT:
                    return
                if exc.args[0] not in GRANT_READ_RETRIES:
                    raise
            finally:
                self._disarm(deadline, sql)
        else:
            return
        board = self.store.wake_board
        for key, owner, fence in rows:
            board.grant(key, owner, int(fence))

    def disconnect(self) -> None:
        for deadline in self._deadlines:
            deadline.detach()  # first: the descriptor may be reused once closed
        for raw in self._raws:
            try:
                raw.close()
            except Exception:  # broken already: the server frees its named locks
                pass
