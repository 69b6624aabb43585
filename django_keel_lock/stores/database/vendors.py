"""What the database store does its own way on each database: one class per vendor, each
owning its SQL (a dialect), how its releases reach the waiters of other processes, how it
decides permits, how its clean-up keeps fences increasing, its fast path and its checks.

`DatabaseLockStore` runs the statements (`execute`, `run`, `transaction`: deadlines, retries,
errors) and asks its vendor for the rest; nothing else in the store asks which database it is
on. The wake-up mechanisms are the three vendors' own:

- PostgreSQL: the release statement NOTIFYs (`PostgresListener` LISTENs);
- MariaDB: a release someone waited for interrupts the naps of the waiters' listeners with
  KILL QUERY (`MariaDBListener`, doorbells of named locks: see `MySQLDialect`);
- SQLite: a release rings datagram doorbells beside the database file (`database.doorbells`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar, cast

from django.core.checks import CheckMessage
from django.db import connections

from ...exceptions import LockStoreUnavailable
from ..base import PERMIT_OWNERS, AcquireResult, Kind, Mode
from ..wakeups import ReleaseListener
from . import checks, pooler
from .dialects.base import Dialect, PermitTransaction, ServerDialect, in_transaction
from .dialects.mysql import MySQLDialect
from .dialects.postgresql import PostgresDialect, is_psycopg3
from .dialects.sqlite import SQLiteDialect
from .doorbells import DoorbellListener, Doorbells
from .libpq import PreparedStatements, Row, Statement
from .listener import MariaDBListener, PostgresListener
from .many import Many, array_literal, int_array
from .many import seconds as _seconds
from .many import text as _text
from .permits import Transaction

if TYPE_CHECKING:
    from .store import DatabaseLockStore

logger = logging.getLogger("django_keel_lock")

T = TypeVar("T")

#: MariaDB's errors of a transaction the server rolled back to end a deadlock (ER_LOCK_DEADLOCK)
#: or one that waited too long for a row lock (ER_LOCK_WAIT_TIMEOUT): contention, not an
#: outage. A multi-key operation runs its transaction again, at most DEADLOCK_RETRIES times.
DEADLOCKS = frozenset({1213, 1205})
DEADLOCK_RETRIES = 3

#: At most this many keys remembered as contended (`ServerVendor.found_contended`).
CONTENDED_KEYS = 1024


class Vendor:
    """The store's ways on one database (see the module's docstring). The base is what every
    vendor shares: permits decided in Python inside one transaction (`database.permits`),
    releases that reach no other process by themselves, and no line of waiters."""

    dialect_class: ClassVar[type[Dialect]]
    dialect: Dialect
    listener: ClassVar[type[ReleaseListener]]
    #: Whether a release reaches the listeners of other processes' waiters, so that they need
    #: not poll while theirs is ready (PostgreSQL, MariaDB). SQLite's doorbells may miss one.
    pushes_releases: ClassVar[bool] = False

    def __init__(self, store: DatabaseLockStore) -> None:
        self.store = store
        self.dialect = self.new_dialect()

    def new_dialect(self) -> Dialect:
        """The SQL this store speaks (its OPTIONS may choose a variant)."""
        return self.dialect_class()

    # -- connections ----------------------------------------------------------------------
    def set_up(self, connection: Any, durable: bool) -> None:
        """Set up a new driver `connection` of the store: the dialect's session statements."""
        statements = self.session_statements(connection, durable)
        if statements:
            with connection.cursor() as cursor:
                for sql in statements:
                    cursor.execute(sql)

    def session_statements(self, connection: Any, durable: bool) -> Sequence[str]:
        return self.dialect.session_sql(durable)

    def fast_path(self, wrapper: Any) -> PreparedStatements | None:
        """The libpq path of the store's connection `wrapper` (see `libpq`), if it has one."""
        return None

    def lost_session(self, exc: Exception) -> bool:
        """Whether the driver error `exc` says the connection's session was not there for the
        statement, which therefore did not run (retried on a new connection)."""
        return False

    def may_listen(self, raw: Any) -> bool:
        """Whether the listener may listen on its driver connection `raw` (see `listener`)."""
        return True

    def callers_transaction(self, database: str) -> Any:
        """The calling thread's own driver connection to `database` when lock statements must
        run on it, inside its open transaction, instead of on the store's connection (which
        would wait behind that transaction); None to use the store's connection."""
        return None

    @classmethod
    def check_database(cls, database: str, stores: str) -> list[CheckMessage]:
        """This vendor's own checks of `database`, where `stores` (a phrase) keep locks."""
        return []

    # -- acquire and release --------------------------------------------------------------
    def retake(self, key: str, owner: str, holder: str, ttl: float) -> list[Statement] | None:
        """The statements of an acquire that tries a cheaper one first, where the vendor has
        one for it: run as one call up to the first that returns a row (the acquire's own
        last), whose first column is the fence taken, if any. None: the acquire's own."""
        return None

    def refused(self, key: str) -> list[Row]:
        """What holds `key`, read after an acquire that returned no row: nothing here (an
        acquire's reply always says it)."""
        return []

    def release(self, key: str, owner: str, line: bool) -> bool:
        """Release `key` if `owner` holds it, waking who waits for it (`line`: the database
        has the line's table); whether it did."""
        dialect = self.dialect
        _, count = self.store.execute(
            [(dialect.release_sql, (key, owner))], hot=True, idempotent=False, key=key
        )
        released = count > 0
        self.released(key, released, False)
        return released

    def released(self, key: str, released: bool, waited: bool) -> None:
        """A release ran: if it `released`, wake who waits for `key` (`waited`: it found
        someone refused since the last take)."""
        if released:
            self.announce(key)

    def announce(self, key: str) -> None:
        """A release of `key` happened: wake its waiters in this process."""
        self.store.wake_board.wake(key)

    def doorbells(self) -> Doorbells | None:
        """Where this machine's processes waiting on this store hang their doorbells; None
        where they hang none."""
        return None

    # -- several keys (see `LockStore.acquire_many`) ---------------------------------------
    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        raise NotImplementedError

    def release_many(self, keys: tuple[str, ...], owner: str, line: bool) -> bool:
        """Release each of `keys` that `owner` holds, waking who waits for each (`line`: as
        `release`); whether it held every one."""
        raise NotImplementedError

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        raise NotImplementedError

    # -- permits --------------------------------------------------------------------------
    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float
    ) -> AcquireResult:
        raise NotImplementedError

    def release_permit(self, key: str, owner: str) -> tuple[bool, bool]:
        """(released, someone was refused the key since its last take)."""
        raise NotImplementedError

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        raise NotImplementedError

    # -- clean-up -------------------------------------------------------------------------
    def sweep_params(self, sweeps: Any) -> Sequence[Any] | None:
        """The first parameters of this round's `sweep_select` and `sweep_delete`, None if
        the round may delete no lock rows yet. Here none: the database's one writer computes
        each fence inside its own write (see `DatabaseLockStore._sweep`)."""
        return ()


class PermitsInPython(Vendor):
    """A vendor whose permit operations are each one transaction that `database.permits`
    decides (MariaDB, SQLite), in the statements of `permits`."""

    permits: ClassVar[PermitTransaction]

    def _decide(self, cursor: Any) -> Transaction:
        return Transaction(self.dialect, self.permits, cursor)

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float
    ) -> AcquireResult:
        return self.store.transaction(
            lambda cursor: self._decide(cursor).acquire(key, owner, holder, ttl, mode, writer_wait),
            key=key,
            holder=holder,
        )

    def release_permit(self, key: str, owner: str) -> tuple[bool, bool]:
        return self.store.transaction(
            lambda cursor: self._decide(cursor).release(key, owner), idempotent=False, key=key
        )

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        return self.store.transaction(
            lambda cursor: self._decide(cursor).extend(key, owner, ttl), key=key
        )

    # -- several keys: one transaction (`database.many`) -------------------------------
    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        refused_sql: str = getattr(self.dialect, "refused_sql", "")
        return self.one_transaction(
            lambda cursor: self._many(cursor).acquire(keys, owner, holder, ttl, refused_sql),
            keys=keys,
            holder=holder,
            deadlocked=AcquireResult(None, 0.0, "exclusive", None, keys),
        )

    def release_many(self, keys: tuple[str, ...], owner: str, line: bool) -> bool:
        released: list[tuple[str, bool]] = self.one_transaction(
            lambda cursor: self._many(cursor).release(keys, owner), keys=keys, idempotent=False
        )
        for key, waited in released:
            self.released_one_of_many(key, waited, line)
        return len(released) == len(keys)

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        extended: int = self.one_transaction(
            lambda cursor: self._many(cursor).extend(keys, owner, ttl), keys=keys
        )
        return extended == len(keys)

    def _many(self, cursor: Any) -> Many:
        return Many(self.dialect, self.permits, cursor)

    def one_transaction(
        self,
        body: Callable[[Any], T],
        *,
        keys: tuple[str, ...],
        holder: str | None = None,
        idempotent: bool = True,
        deadlocked: T | None = None,
    ) -> T:
        """`body(cursor)` in one transaction of the store (see `DatabaseLockStore.transaction`).
        `deadlocked`: what a transaction the server chose as a deadlock's victim gives, where
        the database can have deadlocks (see `deadlock_safe`); None: the error is raised."""
        work = self.deadlock_safe(body, deadlocked)
        if work is None:
            return self.store.transaction(body, idempotent=idempotent, key=keys, holder=holder)
        return self.store.run(work, idempotent=idempotent, key=keys, holder=holder)

    def deadlock_safe(
        self, body: Callable[[Any], T], deadlocked: T | None
    ) -> Callable[[Any, Any, Any], T] | None:
        """The work (for `DatabaseLockStore.run`) of `body`'s transaction where the database
        can end it as a deadlock's victim; None where it cannot (SQLite: one writer)."""
        return None

    def released_one_of_many(self, key: str, waited: bool, line: bool) -> None:
        """A multi-key release freed `key` (`waited`: someone was refused it since its take):
        wake who waits for it, as `release` does."""
        self.released(key, True, waited)


class ServerVendor(Vendor):
    """A database server (PostgreSQL, MariaDB): fences from a sequence, so the clean-up draws
    marks; exclusive waiters stand in a line (`database.line`)."""

    dialect: ServerDialect
    pushes_releases = True
    #: Whether a release hands the lock over to the first live waiter in line (see
    #: `LockStore.hands_off`), where the database has the line's table.
    hands_off: ClassVar[bool] = False

    def __init__(self, store: DatabaseLockStore) -> None:
        super().__init__(store)
        # Whether the database has the line's table as migration 0009 leaves it (its
        # `listener` column: `line_table_sql`), as the first connection of the store found
        # (None: none opened yet). A database migrated later gets lines from processes
        # started after that.
        self.line_table: bool | None = None
        # Keys whose last release here handed the lock over (`found_contended`).
        self.contended: set[str] = set()

    def set_up(self, connection: Any, durable: bool) -> None:
        super().set_up(connection, durable)
        if self.line_table is None:
            with connection.cursor() as cursor:
                cursor.execute(self.dialect.line_table_sql)
                self.line_table = bool(cursor.fetchone()[0])

    def sweep_params(self, sweeps: Any) -> Sequence[Any] | None:
        """The mark this round deletes under, once the writers of the mark before have ended
        (see `DatabaseLockStore._sweep`); None until then."""
        store, dialect = self.store, self.dialect
        (drawn,), _ = store.execute([(dialect.sweep_mark_sql, ())])
        busy = {row[0] for row in store.execute([(dialect.sweep_busy_sql, ())])[0]}
        mark = sweeps.mark
        if mark is None or not sweeps.busy.isdisjoint(busy):
            if mark is None:
                sweeps.mark, sweeps.busy = int(drawn[0]), busy
            return None  # no mark yet, or some of its writers still write
        sweeps.mark, sweeps.busy = int(drawn[0]), busy
        return (mark,)

    def wake_first(self, key: str) -> None:
        """Wake the first live waiter of `key`'s line if the lock is free (PostgreSQL: the
        statement NOTIFYs it)."""
        self.store.execute([(self.dialect.wake_first_sql, (key, key))], key=key)

    def leave_line(self, key: str, owner: str) -> None:
        """Take `owner`'s place out of `key`'s line (`LockStore.leave_queue`). A place marked
        with a fence is a grant not taken up: the lock goes on to the next in line, if
        `owner` still holds it at that fence (any acquire of its own drew another; `pass_on`).
        A grant that lapsed meanwhile (one not carried lives no longer than its place)
        passes nothing on: the next is woken to take the free lock, as when a waiter with no
        grant leaves."""
        store, dialect = self.store, self.dialect
        rows, _ = store.execute([(dialect.leave_returning_sql, (key, owner))], key=key)
        if not rows:
            return
        fence = rows[0][0]
        if fence is None or not self.pass_on(key, owner, int(fence)):
            self.wake_first(key)

    def found_contended(self, key: str, waited: bool) -> None:
        """Remember whether `key`'s release here handed the lock over (a multi-key release:
        found someone waiting): its next release goes straight to what hands over (without
        first trying to free the lock alone) if it did."""
        _remember(self.contended, key, waited)

    def pass_on(self, key: str, owner: str, fence: int) -> bool:
        """Release `owner`'s grant of `key` at `fence`, which it leaves untaken, handing the
        lock over to the next in line; whether it still held it."""
        raise NotImplementedError


class Postgres(ServerVendor):
    """PostgreSQL: releases NOTIFY; permits are functions of migration 0003, one statement
    each; acquire, release and extend run through libpq itself with psycopg 3.

    Behind a transaction pooler (`pooled`: OPTIONS TRANSACTION_POOLER, else found out on the
    store's first connection, see `pooler`) a connection's session is not its own: each
    transaction may run on another server connection, and what a session keeps would be left
    for the pooler's next client. So there the store keeps nothing on a session: no prepared
    statements (libpq sends unnamed ones, psycopg prepares none), no SET (DURABLE: False is
    each write's own, see `PostgresDialect`), and no LISTEN but on OPTIONS LISTEN_DATABASE
    (else waiters poll: check W012). A prepared statement found missing (or there already)
    is a pooler found late: the store then behaves as behind one, and the statement, which
    did not run, runs again.
    """

    dialect_class = PostgresDialect
    dialect: PostgresDialect
    listener = PostgresListener
    hands_off = True

    def __init__(self, store: DatabaseLockStore) -> None:
        super().__init__(store)
        # The SQL for sessions that may not be the store's (a transaction pooler in front, or
        # none known yet) and for sessions of its own (see `PostgresDialect`: DURABLE: False
        # set once per session); `pooled` picks.
        self._shared = self.dialect
        durable = store.durable
        self._own = self._shared if durable else PostgresDialect(durable=False, own_session=True)
        self.pooled = store.transaction_pooler
        # What may keep statements on a session (the store's psycopg 3 connections, their
        # libpq paths): told to stop when a pooler is found late (`lost_session`), open
        # as they may be in other threads.
        self._preparing: weakref.WeakSet[Any] = weakref.WeakSet()
        self._preparing_lock = threading.Lock()
        self.isolation_checked = False  # `_check_isolation`
        # The key each thread's release freed last with nobody waiting (`retake`).
        self._freed = threading.local()
        # Whether the database has migration 0011 (capped grants: `capped_table_sql`), as a
        # connection of the store or its listener found (None: none has told yet). Asked on
        # every new connection until one answers: each connection's first statement after.
        self.capped_table: bool | None = None

    def new_dialect(self) -> PostgresDialect:
        return PostgresDialect(durable=self.store.durable)

    def set_up(self, connection: Any, durable: bool) -> None:
        super().set_up(connection, durable)
        if self.capped_table is None:
            with connection.cursor() as cursor:
                cursor.execute(self.dialect.capped_table_sql)
                self.found_capped(bool(cursor.fetchone()[0]))

    def found_capped(self, capped: bool) -> None:
        """A connection (the store's, or its listener's: `PostgresListener.prepare`) found
        whether the database has migration 0011; the first answer counts."""
        if self.capped_table is not None:
            return
        if not capped:  # before the flag: no connection runs the capped statements then
            for dialect in {self._shared, self._own}:
                dialect.before_capped_grants()
        self.capped_table = capped

    @property
    def pooled(self) -> bool | None:
        """Whether a transaction pooler is in front (None: no connection has told yet)."""
        return self._pooled

    @pooled.setter
    def pooled(self, pooled: bool | None) -> None:
        # Before the dialect: a connection set up once `pooled` is False gets its session
        # settings from the dialect of sessions of the store's own, but only where the
        # settings say there is no transaction pooler (TRANSACTION_POOLER: False). Found out
        # (None), a pooler may be found late, and `synchronous_commit = off` on a session it
        # lends to others would take the flush from their commits.
        explicit = self.store.transaction_pooler is False
        self.dialect = self._own if pooled is False and explicit else self._shared
        self._pooled = pooled

    def session_statements(self, connection: Any, durable: bool) -> Sequence[str]:
        if self.pooled is None:
            self._found(pooler.seen(connection))
        if hasattr(connection, "prepare_threshold"):  # psycopg 3
            self._keeps_statements(connection)
        if not self.pooled:
            return super().session_statements(connection, durable)
        self._check_isolation(connection)
        return ()

    def _check_isolation(self, connection: Any) -> None:
        """Warn (once) when the session default isolation, which a pooled session keeps,
        is stricter than READ COMMITTED: contended acquires and releases then fail on
        serialization errors (see `PostgresDialect.session_sql`)."""
        if self.isolation_checked:
            return
        self.isolation_checked = True
        with connection.cursor() as cursor:
            cursor.execute("SHOW default_transaction_isolation")
            (level,) = cursor.fetchone()
        if level != "read committed":
            logger.warning(
                "lock store %r: database %r runs transactions at %s by default, and behind a "
                "transaction pooler the store cannot set read committed on its session: "
                "contended locks will fail (LockStoreUnavailable, "
                "could not serialize access). Set it for the role: ALTER ROLE ... SET "
                "default_transaction_isolation = 'read committed'.",
                self.store.alias,
                self.store.database,
                level,
            )

    def _keeps_statements(self, preparing: Any) -> None:
        """Remember `preparing` (a psycopg 3 connection or a libpq path) to stop its prepared
        statements once a pooler is found; at once if it is known already."""
        with self._preparing_lock:
            if not self.pooled:
                self._preparing.add(preparing)
                return
        _unprepared(preparing)

    def _found(self, seen: pooler.Seen) -> None:
        """The store's first connection (or its listener's) says whether a pooler is in
        front; a warning says what that turns off."""
        if self.pooled is not None:
            return
        self.pooled = seen.pooled
        if seen.pooled:
            store = self.store
            logger.warning(
                "lock store %r: database %r is reached through a pooler or proxy (the server "
                "sees the connection from %s, not %s): no prepared statements, no session "
                "settings%s. If it pools by session or is no pooler, set OPTIONS "
                "TRANSACTION_POOLER: False.",
                store.alias,
                store.database,
                seen.server,
                seen.ours,
                ""
                if store.listen_database
                else (
                    ", no LISTEN (waiters poll; set OPTIONS LISTEN_DATABASE to a database "
                    "alias that reaches PostgreSQL directly)"
                ),
            )

    def fast_path(self, wrapper: Any) -> PreparedStatements | None:
        # Not where the project turned psycopg's prepared statements off
        # (`"prepare_threshold": None`); behind a transaction pooler, unnamed statements.
        options = wrapper.settings_dict.get("OPTIONS") or {}
        if not is_psycopg3(wrapper) or options.get("prepare_threshold") is None:
            return None
        path = PreparedStatements(wrapper.connection.pgconn, named=not self.pooled)
        if path.named:
            self._keeps_statements(path)
        return path

    def lost_session(self, exc: Exception) -> bool:
        # 26000: no prepared statement of that name; 42P05: one is there already (another
        # client's, on the server connection the pooler gave us).
        if getattr(exc, "sqlstate", None) not in ("26000", "42P05"):
            return False
        if not self.pooled:
            with self._preparing_lock:
                self.pooled = True
                preparing, self._preparing = list(self._preparing), weakref.WeakSet()
            for each in preparing:  # connections of other threads too: from their next call
                _unprepared(each)
            logger.warning(
                "lock store %r: database %r lost a prepared statement (%s): a transaction "
                "pooler is in front; the store keeps nothing on sessions from now on. Set "
                "OPTIONS TRANSACTION_POOLER: True to say so from the start.",
                self.store.alias,
                self.store.database,
                exc,
            )
        return True

    def may_listen(self, raw: Any) -> bool:
        if self.store.listen_database:
            return True  # a database alias named for this: trusted to keep a session
        if self.pooled is None:
            self._found(pooler.seen(raw))
        return not self.pooled

    def release(self, key: str, owner: str, line: bool) -> bool:
        # The statement NOTIFYs the key's waiters itself, or hands the lock over to the
        # first of its line and NOTIFYs that one.
        dialect = self.dialect
        if line:
            # Where the last release of key here handed over, the function alone: someone most
            # likely waits again (a miss costs a plain release the function's call).
            if key in self.contended:
                return self._handed(key, dialect.hand_off_sql, (key, owner))
            return self._handed(key, dialect.release_line_sql, (key, owner, key, owner))
        _, count = self.store.execute(
            [(dialect.release_sql, (key, owner))], hot=True, idempotent=False, key=key
        )
        self.released(key, count > 0, False)
        return count > 0

    def retake(self, key: str, owner: str, holder: str, ttl: float) -> list[Statement] | None:
        # The key this thread freed last (`_handed`), nobody waiting: its row is most likely
        # still free, and taken by one UPDATE (`PostgresDialect.retake_sql`), else by the
        # upsert; once only.
        freed = self._freed
        if getattr(freed, "key", None) != key:
            return None
        freed.key = None
        dialect = self.dialect
        return [
            (dialect.retake_sql, (owner, holder, ttl, owner, key, owner)),
            (dialect.acquire_sql[0], (key, owner, holder, ttl, owner, owner)),  # acquire_params
        ]

    def _handed(self, key: str, sql: str, params: Sequence[Any]) -> bool:
        """Run `sql`, a call of the release function (`release_line_sql`, `pass_on_sql`):
        whether it released. A grant it carried to a waiter of this process is that waiter's
        at once, with no call (it went to its listener too: whichever comes first counts);
        else this process's waiters are woken as by any release. No row: `release_line_sql`
        freed a lock nobody waited for without the function."""
        rows, _ = self.store.execute([(sql, params)], hot=True, idempotent=False, key=key)
        if not rows:
            self._freed.key = key
            self.released(key, True, False)
            return True
        row = rows[0]
        released, owner, fence, carried = row[:4]
        self.found_contended(key, owner is not None)
        if _true(released) and _true(carried):
            capped = row[4] if len(row) > 4 else None  # good_for (migration 0011)
            good_for = None if capped is None else float(capped)
            self.store.wake_board.grant(key, _text(owner) or "", int(fence), good_for)
            return True
        self.released(key, _true(released), False)
        return _true(released)

    def pass_on(self, key: str, owner: str, fence: int) -> bool:
        return self._handed(key, self.dialect.pass_on_sql, (key, owner, fence))

    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        # One call of migration 0008's function (one round trip, by libpq where it can).
        params = (array_literal(keys), owner, holder, ttl)
        rows, _ = self.store.execute(
            [(self.dialect.acquire_many_sql, params)], hot=True, key=keys, holder=holder
        )
        fences, retry_in, held_as, blocked = rows[0][:4]
        if fences is not None:
            taken = tuple(int_array(fences))
            return AcquireResult(max(taken), fences=taken)
        return AcquireResult(
            None,
            _seconds(retry_in),
            PERMIT_OWNERS.get(_text(held_as) or "", "exclusive"),
            None,
            tuple(keys[at - 1] for at in int_array(blocked)),
        )

    def release_many(self, keys: tuple[str, ...], owner: str, line: bool) -> bool:
        # The statement NOTIFYs each key's waiters itself, or the first of its line.
        sql = self.dialect.release_many_sql(len(keys), line)
        rows, _ = self.store.execute([(sql, (*keys, owner))], hot=True, idempotent=False, key=keys)
        for row in rows:
            self.announce(_text(row[0]) or "")
        return len(rows) == len(keys)

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        sql = self.dialect.extend_many_sql(len(keys))
        rows, _ = self.store.execute([(sql, (*keys, owner, ttl))], hot=True, key=keys)
        return len(rows) == len(keys)

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float
    ) -> AcquireResult:
        params = (key, owner, holder, ttl, mode.kind, mode.limit, writer_wait)
        rows, _ = self.store.execute(
            [(self.dialect.acquire_permit_sql, params)], hot=True, key=key, holder=holder
        )
        fence, retry_in, held_as = rows[0][:3]
        if fence is not None:
            return AcquireResult(int(fence))
        return AcquireResult(None, _seconds(retry_in), cast(Kind, _text(held_as)))

    def release_permit(self, key: str, owner: str) -> tuple[bool, bool]:
        rows, _ = self.store.execute(
            [(self.dialect.release_permit_sql, (key, owner))], hot=True, idempotent=False, key=key
        )
        return bool(int(rows[0][0])), False  # the function NOTIFYs itself

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        rows, _ = self.store.execute(
            [(self.dialect.extend_permit_sql, (key, owner, ttl))], hot=True, key=key
        )
        return bool(int(rows[0][0]))


class MariaDB(PermitsInPython, ServerVendor):
    """MariaDB: a release that someone waited for rings the key's doorbell, interrupting the
    naps of the waiters' listeners with KILL QUERY (see `MySQLDialect`). Where the database
    has the line's table, a release that finds the first live waiter in line hands the lock
    over to it in its transaction (`_hand_over`), and interrupts only its listener's nap;
    that listener then reads the grants carried to its process (`MariaDBListener`)."""

    dialect_class = MySQLDialect
    dialect: MySQLDialect
    permits = MySQLDialect.transaction
    listener = MariaDBListener
    hands_off = True

    def __init__(self, store: DatabaseLockStore) -> None:
        super().__init__(store)
        # Keys whose last release here found the flag up and nobody in line: their next
        # release starts with `release_unlined_sql` (`_release_unlined`).
        self.flagged: set[str] = set()

    @classmethod
    def check_database(cls, database: str, stores: str) -> list[CheckMessage]:
        return checks.check_process_privilege(database, stores)

    def session_statements(self, connection: Any, durable: bool) -> Sequence[str]:
        # A transaction whose client went silent (a link that stalled: the server sees no
        # close) would keep its rows locked until the server's wait_timeout, hours: a release
        # that hands over, stalled before its COMMIT, would strand the lock long past its
        # ttl. The server ends a transaction idle as long as the client waits for a reply.
        idle = math.ceil(self.store.socket_timeout)
        idle_sql = self.dialect.idle_transaction_sql.format(seconds=idle)
        return (*super().session_statements(connection, durable), idle_sql)

    def release(self, key: str, owner: str, line: bool) -> bool:
        # One statement while nobody waits (the flag is down: `release_free_sql`); else the
        # transaction that hands the lock over (`_hand_over`), at once for a key whose last
        # release here handed it over.
        store, dialect = self.store, self.dialect
        if line and key in self.contended:
            return self._hand_over(key, owner)
        if line and key in self.flagged:
            return self._release_unlined(key, owner)
        sql = dialect.release_free_sql if line else dialect.release_sql

        def plain(cursor: Any, libpq: Any, database: Any) -> tuple[bool, bool]:
            cursor.execute(sql, (key, owner))
            return cursor.rowcount > 0, dialect.released_waiting(cursor)

        released, waited = store.run(plain, idempotent=False, key=key)
        if line and not released:
            return self._release_unlined(key, owner)
        self.released(key, released, waited)
        return released

    def _release_unlined(self, key: str, owner: str) -> bool:
        """Release `owner`'s lock of `key` in one statement unless a live waiter stands in
        its line (`release_unlined_sql`), ringing the doorbell if its flag was up (a caller
        outside the line was refused); else hand it over (`_hand_over`). Whether it
        released."""
        sql = self.dialect.release_unlined_sql

        def plain(cursor: Any, libpq: Any, database: Any) -> tuple[bool, int]:
            cursor.execute(sql, (key, owner))
            return cursor.rowcount > 0, int(cursor.lastrowid or 0)

        held, outcome = self.store.run(plain, idempotent=False, key=key)
        if held and outcome > 1:
            self.flagged.discard(key)
            return self._hand_over(key, owner)
        if held:
            _remember(self.flagged, key, outcome == 1)
            self.released(key, True, outcome == 1)
        return held

    def _hand_over(self, key: str, owner: str, fence: int | None = None) -> bool:
        """Release `owner`'s lock of `key` (at `fence`, where given: a grant passed on) in
        the transaction that hands it over to the first live waiter in line
        (`_handing_over`); then wake: the grant carried to a waiter of this process (on the
        board), or this process's waiters, and the whole doorbell where someone waited but
        nobody in line could be reached. Whether it released."""
        work = self._handing_over(key, owner, fence)
        released, waited, grant = self.store.run(work, idempotent=False, key=key)
        if not released:
            return False
        self.found_contended(key, grant is not None)
        _remember(self.flagged, key, waited and grant is None)
        if grant is not None and grant.carried:
            assert grant.fence is not None
            self.store.wake_board.grant(key, grant.owner, grant.fence)
        else:
            self.announce(key)
        if waited and (grant is None or not grant.listener):
            self._ring(key)
        return True

    def _handing_over(self, key: str, owner: str, fence: int | None) -> Any:
        """The work (for `run`) of a release that hands over, one transaction: the lock row
        and the first live waiter in line handed nothing yet, if its flag is up, read and
        locked (`hand_over_sql`), then the grant to that waiter (`_grant`) or the lock
        freed, and a KILL QUERY that ends the nap of that waiter's listener before the
        COMMIT: the listener's read of its process's grants waits for the lock row until the
        transaction ends (`MySQLDialect.grants_wait_sql`), so the waiter's wake-up overlaps
        the commit's flush. (released, waited, the grant or None)."""
        dialect = self.dialect
        params = (owner, fence, fence, owner, key)

        def work(cursor: Any, libpq: Any, database: Any) -> tuple[bool, bool, _Grant | None]:
            def body(cursor: Any) -> tuple[bool, bool, _Grant | None]:
                cursor.execute(dialect.hand_over_sql, params)
                row = cursor.fetchone()
                if row is None or not row[0]:
                    return False, False, None
                grant = self._grant(cursor, key, row[2:]) if row[2] is not None else None
                if grant is None or grant.fence is None:
                    cursor.execute(dialect.free_sql, (key,))
                if grant is not None and grant.listener:
                    self._kill(cursor, database, key, self._others([grant.listener]))
                return True, bool(row[1]), grant

            return in_transaction(cursor, dialect.begin_sql, body)

        return work

    def _grant(self, cursor: Any, key: str, first: Sequence[Any]) -> _Grant:
        """Hand `key`'s lock, being released, over to the `first` live waiter in line handed
        nothing yet (`hand_over_sql`'s columns), inside the release's transaction: its
        owner, holder and the fence drawn, for its whole ttl while the listener its place
        names still holds its wake address (the grant is then carried: its process reads it
        once woken, and the waiter holds the lock with no call), else for min(its ttl, what
        is left of its place), which its next attempt takes up. A place written before
        hand-offs (no ttl) is handed nothing (fence None): only woken."""
        place, waiter, holder, ttl, left, listening, listener, fence = first[:8]
        if ttl is None:
            return _Grant(waiter, None, False, int(listening))
        dialect = self.dialect
        whole = dialect.interval(float(ttl))
        carried = bool(listening) and listener is not None and int(listener) == int(listening)
        length = whole if carried else min(whole, int(left))
        cursor.execute(dialect.grant_sql, (waiter, holder, fence, length, fence, key, place))
        return _Grant(waiter, int(fence), carried, int(listening))

    def pass_on(self, key: str, owner: str, fence: int) -> bool:
        return self._hand_over(key, owner, fence)

    def released(self, key: str, released: bool, waited: bool) -> None:
        super().released(key, released, waited)
        if released and waited:
            self._ring(key)

    def deadlock_safe(
        self, body: Callable[[Any], T], deadlocked: T | None
    ) -> Callable[[Any, Any, Any], T] | None:
        # READ COMMITTED (the next transaction's, set before it begins): each read sees the
        # latest row, and inserts of new keys take no gap locks another set's inserts wait
        # for. A transaction the server rolled back to end a deadlock did nothing: it runs
        # again, and after DEADLOCK_RETRIES gives `deadlocked` (a refusal to retry at once).
        dialect = self.dialect

        def work(cursor: Any, libpq: Any, database: Any) -> T:
            for attempt in range(DEADLOCK_RETRIES + 1):
                cursor.execute(dialect.read_committed)
                try:
                    return in_transaction(cursor, dialect.begin_sql, body)
                except database.OperationalError as exc:
                    if exc.args[0] not in DEADLOCKS or (
                        deadlocked is None and attempt == DEADLOCK_RETRIES
                    ):
                        raise
            assert deadlocked is not None
            return deadlocked

        return work

    def released_one_of_many(self, key: str, waited: bool, line: bool) -> None:
        self.announce(key)
        if line:
            self.found_contended(key, waited)
        if waited:
            self._ring(key, line=line)

    def wake_first(self, key: str) -> None:
        """Interrupt the nap of the first live waiter's listener if the lock is free, or
        ring the key's doorbell if it has no listener to reach."""
        rows, _ = self.store.execute([(self.dialect.wake_first_sql, (key, key))], key=key)
        if not rows or rows[0][0] is None:
            return
        if int(rows[0][0]):
            self._interrupt(key, [rows[0][0]])
        else:
            self._ring(key)

    def _ring(self, key: str, line: bool = False) -> None:
        """Interrupt the nap of every other listener subscribed to `key` (`line`: of only the
        first waiter in its line, where it has a listener to reach)."""
        dialect = self.dialect

        def work(cursor: Any, libpq: Any, database: Any) -> list[Any]:
            if line:
                cursor.execute(dialect.ring_line_sql, (key, key, *dialect.bell_names(key)))
                first, *bells = cursor.fetchall()[0]
                return [first] if first else bells
            cursor.execute(dialect.ring_sql, dialect.bell_names(key))
            return list(cursor.fetchall()[0])

        try:
            listening = self.store.run(work, key=key)
        except LockStoreUnavailable as exc:
            logger.debug("lock store %r: ringing for %r failed: %s", self.store.alias, key, exc)
            return
        self._interrupt(key, listening)

    def _interrupt(self, key: str, listening: Sequence[Any]) -> None:
        """KILL QUERY the naps of the listeners whose connection ids are `listening` (None:
        a free slot), but this process's. A failure is only logged: the release went through,
        and a lost ring costs its waiters one poll."""
        targets = self._others(listening)
        if not targets:
            return
        try:
            self.store.run(
                lambda cursor, libpq, database: self._kill(cursor, database, key, targets), key=key
            )
        except LockStoreUnavailable as exc:
            logger.debug("lock store %r: ringing for %r failed: %s", self.store.alias, key, exc)

    def _others(self, listening: Sequence[Any]) -> list[int]:
        """The connection ids in `listening` but None and this process's listener's."""
        listener = self.store.release_listener  # a forked child's is its parent's: ring it too
        mine = (
            getattr(listener, "connection_id", None) if listener and listener.usable_here else None
        )
        return [int(value) for value in listening if value is not None and int(value) != mine]

    def _kill(self, cursor: Any, database: Any, key: str, targets: Sequence[int]) -> None:
        """KILL QUERY each of `targets` on `cursor`; one refused (see `kill_refusals`) is
        skipped."""
        dialect = self.dialect
        for target in targets:
            try:
                cursor.execute(dialect.kill_sql, (target,))
            except database.OperationalError as exc:
                if exc.args[0] not in dialect.kill_refusals:
                    raise
                logger.debug("lock store %r cannot ring %r: %s", self.store.alias, key, exc)


def _remember(keys: set[str], key: str, found: bool) -> None:
    """Keep `key` in `keys` (`ServerVendor.contended`, MariaDB's `flagged`) if `found`, else
    drop it; at most CONTENDED_KEYS, a rough bound: a key forgotten costs its next release a
    statement more."""
    if not found:
        keys.discard(key)
    elif key not in keys:
        if len(keys) >= CONTENDED_KEYS:
            keys.clear()
        keys.add(key)


class _Grant(NamedTuple):
    """A MariaDB release's hand-over: to whom, at which fence (None: a place written before
    hand-offs, only woken), whether for the waiter's whole ttl (`MariaDB._grant`), and the
    connection id of its process's listener (0: none to reach)."""

    owner: str
    fence: int | None
    carried: bool
    listener: int


class SQLite(PermitsInPython):
    """SQLite: one writer at a time, no line of waiters; a release rings the doorbells of
    this machine's other waiting processes, who still poll (a ring may be missed)."""

    dialect_class = SQLiteDialect
    dialect: SQLiteDialect
    permits = SQLiteDialect.transaction
    listener = DoorbellListener

    def __init__(self, store: DatabaseLockStore) -> None:
        super().__init__(store)
        self._doorbells: Doorbells | None = None

    def callers_transaction(self, database: str) -> Any:
        return self.dialect.callers_transaction(database)

    def refused(self, key: str) -> list[Row]:
        # The upsert returns no row when it refuses: only a refusal pays for this read.
        return self.store.execute([(self.dialect.refused_sql, (key,))], key=key)[0]

    def doorbells(self) -> Doorbells | None:
        name = connections[self.store.database].settings_dict["NAME"]
        bells = self._doorbells
        if bells is None or bells.name != name:  # the test runner renames the database
            bells = self._doorbells = Doorbells.of(name)
        return bells

    def announce(self, key: str) -> None:
        super().announce(key)
        bells = self.doorbells()
        if bells is not None:
            listener, own = self.store.release_listener, None
            if isinstance(listener, DoorbellListener) and listener.pid == os.getpid():
                own = listener.bell_name
            bells.ring(key, skip=own)


#: The vendors the store supports, by Django's `vendor` of the database: exactly these.
VENDORS: dict[str, type[Vendor]] = {
    vendor.dialect_class.vendor: vendor for vendor in (Postgres, MariaDB, SQLite)
}


def _true(value: Any) -> bool:
    """A boolean column's value (the libpq path gives b"t" or b"f")."""
    return value in (True, b"t", "t")


def _unprepared(preparing: Any) -> None:
    """Stop `preparing` (a psycopg 3 connection or a libpq path) preparing or running named
    statements: behind a transaction pooler a name may stand for another client's statement
    on the server connection a call gets."""
    if isinstance(preparing, PreparedStatements):
        preparing.named = False
    else:
        preparing.prepare_threshold = None


def check_database(database: str, stores: str) -> list[CheckMessage]:
    """The checks of `database`'s vendor (see `Vendor.check_database`)."""
    vendor = VENDORS.get(connections[database].vendor)
    return [] if vendor is None else vendor.check_database(database, stores)
