"""Locks in the `Lock` table, shared by every process and server that shares the database.

- The database's clock decides expiry; the app server's clock is never read.
- Locks live outside the caller's transaction: each thread gets its own autocommit connection,
  so a lock taken inside `atomic()` is visible at once and survives the caller's rollback.
  Not on SQLite, whose one writer would be that transaction: there lock statements join it
  (`SQLiteDialect.callers_transaction`).
- One statement per operation (MariaDB: two for acquire), talking to the driver directly; on
  PostgreSQL with psycopg 3, acquire, release and extend go straight to libpq as statements
  prepared once per connection, skipping the cursor layer (see `libpq`).
- Permits (semaphores, shared locks) live in the `Permit` table, behind their key's lock row
  (see `LockStore.acquire_permit`). On PostgreSQL each permit operation is one call of a
  function of migration 0003, by the same libpq path; elsewhere one transaction that
  `database.permits` decides.
- Other processes' waiters hear of releases through PostgreSQL's LISTEN/NOTIFY (`listener`)
  or, on SQLite, the doorbells beside the database file (`doorbells`).
- Waiters for an exclusive lock stand in a line (PostgreSQL, MariaDB: the `Waiter` table, see
  `database.line`), and a release that someone waited for wakes only the first of them.
- The SQL itself is each vendor's dialect (`dialects`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar, cast

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured, SynchronousOnlyOperation
from django.db import connections

from ...exceptions import LockStoreMisconfigured, LockStoreUnavailable
from ..base import PERMIT_OWNERS, AcquireResult, Kind, LockInfo, LockStore, Mode
from ..connections import Deadline, PerThread, SocketCheck, socket_timeout_option
from ..wakeups import ListeningStore, ReleaseListener
from . import checks
from .dialects import DIALECTS, Dialect
from .dialects.postgresql import is_psycopg3
from .doorbells import DoorbellListener, Doorbells
from .libpq import PreparedStatements, Row, Statement
from .line import Line
from .listener import MariaDBListener, PostgresListener
from .permits import Transaction

logger = logging.getLogger("django_keel_lock")

PAGE_SIZE = 1000
PRUNE_BATCH = 1000
#: Automatic clean-up (`DatabaseLockStore._sweep`): a round every SWEEP_EVERY acquires and
#: releases of a thread, each deleting at most SWEEP_BATCH free lock rows and as many expired
#: permits of keys whose lock row is gone. A round is a mark and a list of the table's writers
#: (PostgreSQL, MariaDB), then, once the writers of the mark before have ended, a read and a
#: delete of permits and the same of locks (the deletes only where the read found rows).
#: A free row waits at most two rounds, so a busy thread leaves about SWEEP_EVERY free rows
#: behind it (fewer with more threads), within one batch.
SWEEP_EVERY = 500
SWEEP_BATCH = 1000
#: At most this many keys remembered as contended (`DatabaseLockStore._found_contended`).
CONTENDED_KEYS = 1024
T = TypeVar("T")
_Result = tuple[list[Row], int]
#: The listener of each `Dialect.listener`.
LISTENERS: Mapping[str, type[ReleaseListener]] = {
    "notify": PostgresListener,
    "named-locks": MariaDBListener,
    "doorbells": DoorbellListener,
}


class DatabaseLockStore(ListeningStore, LockStore):
    """The default store: the `Lock` table in a Django database (OPTIONS: DATABASE, DURABLE,
    SOCKET_TIMEOUT).

    DURABLE=False (PostgreSQL) skips the commit flush for lock writes: faster, but a database
    crash can forget locks taken in the last moments before it, so two holders may then overlap.

    SOCKET_TIMEOUT (seconds, default 5) is the longest a call waits for the server: to connect
    (whole seconds, the drivers' unit; libpq waits at least 2), to set up a new connection, and
    for a call's statements. A call past it raises LockStoreUnavailable and its connection is
    dropped (see `connections.Deadline`). SQLite has no server to wait for: it ignores it.
    """

    max_key_length = 255
    option_names = frozenset({"DATABASE", "DURABLE", "SOCKET_TIMEOUT"})

    @staticmethod
    def database_option(options: Mapping[str, Any]) -> Any:
        """The DATABASES alias a store with these OPTIONS keeps its locks in."""
        return options.get("DATABASE", "default")

    @classmethod
    def check_config(cls, alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
        return checks.check_config(alias, cls.database_option(options), options)

    @classmethod
    def check_servers(
        cls, stores: Mapping[str, Mapping[str, Any]], *, databases: Sequence[str]
    ) -> list[CheckMessage]:
        on = {alias: cls.database_option(options) for alias, options in stores.items()}
        return checks.check_tables(on, databases)

    @property
    def table_database(self) -> str:
        return self.database

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        self.database: str = self.database_option(self.options)
        if self.database not in connections.settings:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS DATABASE {self.database!r} is not in "
                f"DATABASES (configured: {', '.join(connections.settings)})"
            )
        self.durable = bool(self.options.get("DURABLE", True))
        self.socket_timeout = socket_timeout_option(alias, self.options)
        self._threads: PerThread[_ThreadConnection] = PerThread(_close_connection)
        # False once the driver turned out to have no LISTEN (psycopg2), or SQLite's doorbells
        # could not be set up.
        self.push_possible = True
        self._doorbells: Doorbells | None = None
        self._sweeps = _Sweeps()
        # (key, owner) of this process's waiters that stand in a line: their attempts go
        # straight to the line's transaction (the plain upsert could take the lock out of
        # turn when a take by a non-waiting acquire lowered the flag meanwhile).
        self._in_line: set[tuple[str, str]] = set()
        # Keys whose last release here found someone waiting (MariaDB, `_found_contended`).
        self._contended: set[str] = set()

        # Whether the database has the line's table (migration 0005), as the first connection
        # of the store found (None: none opened yet). A database migrated later gets lines
        # from processes started after that.
        self._line_table: bool | None = None

    @property
    def queues(self) -> bool:  # type: ignore[override]
        # Before the first connection tells (`_has_line`), a wait stands in the line: its
        # attempts find out, and go on as plain acquires where the table is missing.
        return self.dialect.line is not None and self._line_table is not False

    def _has_line(self) -> bool:
        """Whether this store keeps lines: its dialect has them and its database the table.
        Opens this thread's connection if need be (the first one finds out)."""
        if self.dialect.line is None:
            return False
        if self._line_table is None:
            self._open()
        return bool(self._line_table)

    # -- connections ----------------------------------------------------------------------
    def _connection_settings(self) -> dict[str, Any]:
        """The database's settings for a connection of our own: never from Django's pool
        (we would drain it and never give connections back), in autocommit whatever the
        project's AUTOCOMMIT (each lock statement commits on its own, or nobody else would
        see it), psycopg 3 tuned for our few statements, MariaDB in utf8mb4."""
        base = connections[self.database]
        settings = dict(base.settings_dict, AUTOCOMMIT=True)
        options = dict(settings.get("OPTIONS") or {})
        options.pop("pool", None)
        if base.vendor in DIALECTS:
            self.dialect.connection_options(options, base, self.socket_timeout)
        settings["OPTIONS"] = options
        return settings

    def _libpq_possible(self, settings: Mapping[str, Any]) -> bool:
        """Whether the hot statements may be prepared once per connection and run through
        libpq itself: psycopg 3, and prepared statements not turned off (pgbouncer in
        transaction mode needs `"prepare_threshold": None`)."""
        base = connections[self.database]
        options = settings.get("OPTIONS") or {}
        return (
            base.vendor == "postgresql"
            and is_psycopg3(base)
            and options.get("prepare_threshold") is not None
        )

    def _new_wrapper(self, deadline: Deadline | None = None) -> Any:
        """A connected wrapper of our own. Its setup (Django's, `connection_created`
        receivers', the dialect's session statements) runs under `deadline` (a new one by
        default), which watches the connection's socket from its first moment on."""
        if deadline is None:
            deadline = Deadline(self.socket_timeout)
        base = connections[self.database]
        wrapper: Any = type(base)(self._connection_settings(), self.database)
        # We keep one connection per thread ourselves; sharing is allowed only so close() and
        # the end of a thread can shut it from another thread.
        wrapper.inc_thread_sharing()
        connect = wrapper.get_new_connection

        def get_new_connection(params: Any) -> Any:
            raw = connect(params)  # the driver's connect_timeout bounds this part
            fileno = getattr(raw, "fileno", None)
            if fileno is not None:
                deadline.attach(fileno())
                deadline.arm()
            return raw

        wrapper.get_new_connection = get_new_connection
        try:
            wrapper.ensure_connection()
            dialect = self.dialect if wrapper.vendor in DIALECTS else None
            session = dialect.session_sql(self.durable) if dialect is not None else ()
            probe = dialect.line_table_sql if dialect is not None else ""
            if session or probe:
                with wrapper.connection.cursor() as cursor:
                    for sql in session:
                        cursor.execute(sql)
                    if probe and self._line_table is None:
                        cursor.execute(probe)
                        self._line_table = bool(cursor.fetchone()[0])
        except BaseException as exc:
            timed_out = deadline.disarm()
            _close_raw(wrapper, deadline)
            if timed_out and isinstance(exc, Exception):
                raise self._timed_out() from exc
            raise
        if deadline.disarm():  # set up just as the socket was cut: unusable
            _close_raw(wrapper, deadline)
            raise self._timed_out()
        return wrapper

    def _timed_out(self) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"lock store {self.alias!r} (database {self.database!r}): no reply within "
            f"{self.socket_timeout:g}s (OPTIONS SOCKET_TIMEOUT); the connection was dropped"
        )

    def _connection(self) -> tuple[_ThreadConnection, bool]:
        """This thread's own autocommit connection; True if it was opened just now."""
        conn = self._threads.get()
        if conn is not None:
            return conn, False
        deadline = Deadline(self.socket_timeout)
        wrapper = self._new_wrapper(deadline)
        libpq = (
            PreparedStatements(wrapper.connection.pgconn)
            if self._libpq_possible(wrapper.settings_dict)
            else None
        )
        return self._threads.put(_ThreadConnection(wrapper, deadline, libpq)), True

    @property
    def dialect(self) -> Dialect:
        dialect: Dialect | None = getattr(self, "_dialect", None)
        if dialect is None:
            vendor = connections[self.database].vendor
            if vendor not in DIALECTS:
                raise LockStoreUnavailable(
                    f"DatabaseLockStore supports PostgreSQL, MariaDB and SQLite, "
                    f"not {vendor!r} (database {self.database!r})"
                )
            dialect = self._dialect = DIALECTS[vendor]()
        return dialect

    def _execute(
        self,
        statements: Sequence[Statement],
        *,
        hot: bool = False,
        idempotent: bool = True,
        after: Sequence[Statement] = (),
        key: str | None = None,
        holder: str | None = None,
    ) -> tuple[list[Row], int]:
        """Run `statements` in autocommit, then `after` on the same connection (what closes
        prune's guard); (rows, rowcount) of the last of `statements`.

        `hot` statements (acquire, release, extend: they return only numbers) take the
        connection's libpq path where it has one; their values may then come back as bytes,
        which int() and float() read alike.

        A statement that failed after it was sent may still have run. Idempotent operations
        (all but release, for the same owner) are then retried once on a fresh connection: the
        server restarted, or a proxy dropped an idle one. A release retried after its commit
        would find the lock gone and report it lost, so it is never retried; it goes out only
        on a connection with nothing unread (one the server closed has an error or EOF
        waiting), replaced first if need be. Any other failure is LockStoreUnavailable. Any
        other exception (a task's time limit, Ctrl-C) drops the connection, and with it
        whatever it was in the middle of, such as a prune's open transaction.

        A data exception (a value the database cannot take: a key outside its encoding) is a
        ValueError naming `key` (and `holder`), and keeps the connection: it is healthy.

        Where the dialect says so (SQLite inside the caller's transaction), the statements run
        on the caller's own connection instead, once, and leave it open whatever happens.

        The statements (and `after`) wait at most SOCKET_TIMEOUT for the server, together.
        One that gets no reply in time is not retried: a server that does not answer now
        would only make the caller wait as long again.
        """
        assert not (hot and after), "the libpq path runs no closing statements"

        def work(cursor: Any, libpq: PreparedStatements | None, database: Any) -> _Result:
            if hot and libpq is not None:
                return libpq.execute(statements, database.OperationalError)
            for sql, params in statements:
                cursor.execute(sql, params)
            result = (cursor.fetchall() if cursor.description else []), cursor.rowcount
            for sql, params in after:
                cursor.execute(sql, params)
            return result

        return self._run(work, idempotent=idempotent, closing=bool(after), key=key, holder=holder)

    def _transaction(
        self,
        body: Callable[[Any], T],
        *,
        idempotent: bool = True,
        key: str | None = None,
        holder: str | None = None,
    ) -> T:
        """`body(cursor)` inside one transaction (the dialect's `begin_sql` ... COMMIT), by
        `_execute`'s rules. Inside the caller's transaction (SQLite), in a savepoint of it
        instead: a failure midway leaves the caller's transaction as it was."""
        return self._run(body, transaction=True, idempotent=idempotent, key=key, holder=holder)

    def _run(
        self,
        work: Callable[..., T],
        *,
        transaction: bool = False,
        idempotent: bool = True,
        closing: bool = False,
        key: str | None = None,
        holder: str | None = None,
    ) -> T:
        """What `_execute` and `_transaction` share: `work(cursor, libpq, driver)` (or, in a
        `transaction`, `work(cursor)`) with the deadline, retry and error rules `_execute`
        states. `closing`: work ends by closing a guard, so even a data exception drops the
        connection."""
        joined = self.dialect.callers_transaction(self.database)
        if joined is not None:
            return self._run_joined(joined, work, transaction, key, holder)
        for attempt in (1, 2):
            conn, fresh = self._open()
            if not idempotent and not fresh and conn.stale():
                self._threads.drop()
                conn, fresh = self._open()
            database, deadline = conn.wrapper.Database, conn.deadline
            deadline.arm()
            try:
                if transaction:
                    result = _in_transaction(conn.cursor, self.dialect.begin_sql, work)
                else:
                    result = work(conn.cursor, conn.libpq, database)
            except database.Error as exc:
                timed_out = deadline.disarm()
                if isinstance(exc, database.DataError) and not closing and not timed_out:
                    raise self._refused(exc, key, holder) from exc
                self._threads.drop()
                if timed_out:
                    raise self._timed_out() from exc
                if _missing_schema(exc):
                    raise self._not_migrated(exc) from exc
                if fresh or attempt == 2 or not idempotent:
                    raise LockStoreUnavailable(
                        f"lock store {self.alias!r} (database {self.database!r}) failed: {exc}"
                    ) from exc
                continue
            except BaseException:
                deadline.disarm()
                self._threads.drop()
                raise
            if deadline.disarm():  # the reply made it just as the socket was cut
                self._threads.drop()
            return result
        raise AssertionError("unreachable")

    def _run_joined(
        self,
        raw: Any,
        work: Callable[..., T],
        transaction: bool,
        key: str | None,
        holder: str | None,
    ) -> T:
        """`_run` on the caller's driver connection `raw`, inside its transaction: no retry,
        and the connection is the caller's to keep whatever happens."""
        base: Any = connections[self.database]
        database = base.Database
        cursor = raw.cursor()
        try:
            if transaction:
                return _in_savepoint(cursor, work)
            return work(cursor, None, database)
        except database.DataError as exc:
            raise self._refused(exc, key, holder) from exc
        except database.Error as exc:
            if _missing_schema(exc):
                raise self._not_migrated(exc) from exc
            raise LockStoreUnavailable(
                f"lock store {self.alias!r} (database {self.database!r}, inside the caller's "
                f"transaction) failed: {exc}"
            ) from exc
        finally:
            cursor.close()

    def _not_migrated(self, exc: Exception) -> LockStoreMisconfigured:
        return LockStoreMisconfigured(
            f"lock store {self.alias!r}: database {self.database!r} lacks the lock tables "
            f"(django_keel_lock's migrations are not applied there: {exc}); run: python "
            f"manage.py migrate django_keel_lock --database {self.database}"
        )

    def _refused(self, exc: Exception, key: str | None, holder: str | None) -> ValueError:
        what = "a value" if key is None else f"key {key!r}"
        if holder is not None:
            what += f" or holder {holder!r}"
        return ValueError(
            f"lock store {self.alias!r} (database {self.database!r}) cannot store {what}: {exc}"
        )

    def _open(self) -> tuple[_ThreadConnection, bool]:
        """`_connection()`, a failure to connect being LockStoreUnavailable."""
        try:
            return self._connection()
        except (SynchronousOnlyOperation, LockStoreUnavailable):
            raise  # a programming error (sync call in async code), or said already
        except Exception as exc:
            raise LockStoreUnavailable(
                f"lock store {self.alias!r} cannot connect to database {self.database!r}: {exc}"
            ) from exc

    # -- the protocol ---------------------------------------------------------------------
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        result = self._upsert(self.dialect.acquire_sql, key, owner, holder, ttl)
        self._tick()
        return result

    def _upsert(
        self, statements: Sequence[str], key: str, owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        """Run an acquire upsert (`acquire_sql` or `acquire_queued_sql`): its result."""
        dialect = self.dialect
        params = dialect.acquire_params(key, owner, holder, ttl)
        rows, _ = self._execute(
            list(zip(statements, params, strict=True)), hot=True, key=key, holder=holder
        )
        if not rows and dialect.refused_sql:  # only a refusal pays for this read
            rows, _ = self._execute([(dialect.refused_sql, (key,))], key=key)
        if not rows:  # freed since: worth trying again at once
            return AcquireResult(None, 0.0, "exclusive")
        fence, retry_in, marker = rows[0][:3]
        if fence is not None:
            return AcquireResult(int(fence))
        return AcquireResult(
            None, _seconds(retry_in), PERMIT_OWNERS.get(_text(marker) or "", "exclusive")
        )

    # -- the line of waiters (PostgreSQL, MariaDB) -----------------------------------------
    def acquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        dialect = self.dialect
        if not self._has_line():
            if dialect.line is None:
                return super().acquire_queued(key, owner, holder, ttl)
            return self.acquire(key, owner, holder, ttl)  # a database without the table
        self._tick()
        if (key, owner) not in self._in_line:
            # Not in the line yet: as cheap as acquire while nobody waits (PostgreSQL: one
            # statement, by libpq). Refused by permits: not queued.
            result = self._upsert(dialect.acquire_queued_sql, key, owner, holder, ttl)
            if result.acquired or (result.held_as != "exclusive" and result.retry_in):
                return result
        elif dialect.take_first_sql:
            # In the line already, as a rule woken as its first: one statement if it is.
            params = {"owner": owner, "holder": holder, "ttl": dialect.interval(ttl), "key": key}

            def take(cursor: Any, libpq: Any, database: Any) -> int | None:
                cursor.execute(dialect.take_first_sql, params)
                return dialect.taken_fence(cursor)

            fence = self._run(take, key=key, holder=holder)
            if fence is not None:
                self._in_line.discard((key, owner))
                return AcquireResult(fence)
        address = self.wake_address
        result, queued = self._transaction(
            lambda cursor: Line(dialect, cursor).acquire(key, owner, holder, ttl, address),
            key=key,
            holder=holder,
        )
        if queued:
            self._in_line.add((key, owner))
        else:
            self._in_line.discard((key, owner))
        return result

    def leave_queue(self, key: str, owner: str) -> None:
        line = self.dialect.line
        if line is None:
            return super().leave_queue(key, owner)
        if (key, owner) not in self._in_line:
            return  # never joined (or its place was given up already)
        self._in_line.discard((key, owner))
        _, count = self._execute([(line.leave, (key, owner))], key=key)
        if count > 0:
            self._wake_first(key)

    def _wake_first(self, key: str) -> None:
        """Wake the first live waiter of `key`'s line if the lock is free (PostgreSQL: the
        statement NOTIFYs it; MariaDB: interrupt its listener's nap, or ring the key's
        doorbell if it has no listener to reach)."""
        dialect = self.dialect
        rows, _ = self._execute([(dialect.wake_first_sql, (key, key))], key=key)
        if not dialect.ring_sql or not rows or rows[0][0] is None:
            return
        if int(rows[0][0]):
            self._interrupt(key, [rows[0][0]])
        else:
            self._ring(key)

    def release(self, key: str, owner: str) -> bool:
        dialect = self.dialect
        line = self._has_line()
        first: int | None = None
        if dialect.ring_sql:  # MariaDB: the release's own reply says whether someone waited
            # and, for a key found contended, whom to wake (see `Dialect.release_line_sql`).
            if line and key in self._contended:
                released, waited, first = self._run(
                    partial(self._release_waking, key, owner), idempotent=False, key=key
                )
            else:

                def work(cursor: Any, libpq: Any, database: Any) -> tuple[bool, bool, int]:
                    cursor.execute(dialect.release_sql, (key, owner))
                    return cursor.rowcount > 0, *dialect.released_waiting(cursor)

                released, waited, _ = self._run(work, idempotent=False, key=key)
            if released and line:
                self._found_contended(key, waited)
            if first:
                waited = False  # its listener was woken inside the release: nothing to ring
        else:  # PostgreSQL's release NOTIFYs itself; SQLite rings in `_announce`
            sql = dialect.release_line_sql if line else dialect.release_sql
            _, count = self._execute([(sql, (key, owner))], hot=True, idempotent=False, key=key)
            released, waited = count > 0, False
        self._released(key, released, waited, line=True, first=first)
        self._tick()
        return released

    def _release_waking(
        self, key: str, owner: str, cursor: Any, libpq: Any, database: Any
    ) -> tuple[bool, bool, int]:
        """MariaDB's release of a key found contended (`_run`'s work): `release_line_sql` in
        a transaction that interrupts the first waiter's listener before it commits, so that
        the waiter's wake-up and its take overlap the commit (the take waits for the row's
        lock, then finds it released). (released, waited, that listener: 0 if none to
        reach)."""
        dialect = self.dialect

        def body(cursor: Any) -> tuple[bool, bool, int]:
            cursor.execute(dialect.release_line_sql, (key, owner))
            released, (waited, first) = cursor.rowcount > 0, dialect.released_waiting(cursor)
            if released and first:
                self._kill(cursor, database, key, self._others([first]))
            return released, waited, first

        return _in_transaction(cursor, dialect.begin_sql, body)

    def _found_contended(self, key: str, waited: bool) -> None:
        """Remember whether `key`'s release here found someone waiting: its next release
        asks for the first in line in the same statement if it did (MariaDB)."""
        contended = self._contended
        if not waited:
            contended.discard(key)
        elif key not in contended:
            if len(contended) >= CONTENDED_KEYS:
                contended.clear()  # a rough bound: at worst, one ring_line_sql more each
            contended.add(key)

    def _released(
        self, key: str, released: bool, waited: bool, line: bool = False, first: int | None = None
    ) -> None:
        """Wake this process's waiters for `key`, and ring its doorbell for other processes'
        if someone was refused it (see `Dialect.ring_sql`): only its first waiter's listener
        if `line` (an exclusive lock's release) and the key's line has one to reach, `first`
        if the release named it already (0: none to reach)."""
        if not released:
            return
        self._announce(key)
        if not waited or not self.dialect.ring_sql:
            return
        if first:
            self._interrupt(key, [first])
        else:
            self._ring(key, line and first is None)

    def _ring(self, key: str, line: bool = False) -> None:
        """Interrupt the nap of every other listener subscribed to `key` (`line`: of only the
        first waiter in its line, where it has a listener to reach)."""
        dialect = self.dialect

        def work(cursor: Any, libpq: Any, database: Any) -> list[Any]:
            if line and self._line_table:
                cursor.execute(dialect.ring_line_sql, (key, *dialect.bell_names(key)))
                first, *bells = cursor.fetchall()[0]
                return [first] if first else bells
            cursor.execute(dialect.ring_sql, dialect.bell_names(key))
            return list(cursor.fetchall()[0])

        try:
            listening = self._run(work, key=key)
        except LockStoreUnavailable as exc:
            logger.debug("lock store %r: ringing for %r failed: %s", self.alias, key, exc)
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
            self._run(
                lambda cursor, libpq, database: self._kill(cursor, database, key, targets), key=key
            )
        except LockStoreUnavailable as exc:
            logger.debug("lock store %r: ringing for %r failed: %s", self.alias, key, exc)

    def _others(self, listening: Sequence[Any]) -> list[int]:
        """The connection ids in `listening` but None and this process's listener's."""
        listener = self._listener  # a forked child's is its parent's: ring that one too
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
                logger.debug("lock store %r cannot ring %r: %s", self.alias, key, exc)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        dialect = self.dialect
        _, count = self._execute(
            [(dialect.extend_sql, dialect.extend_params(key, owner, ttl))], hot=True, key=key
        )
        return count > 0

    # -- permits --------------------------------------------------------------------------
    # PostgreSQL: one call of a function of migration 0003 each; elsewhere one transaction,
    # decided in Python (`database.permits`).
    supports_modes = True

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        dialect = self.dialect
        self._tick()
        if dialect.acquire_permit_sql:
            params = (key, owner, holder, ttl, mode.kind, mode.limit, writer_wait)
            rows, _ = self._execute(
                [(dialect.acquire_permit_sql, params)], hot=True, key=key, holder=holder
            )
            fence, retry_in, held_as = rows[0][:3]
            if fence is not None:
                return AcquireResult(int(fence))
            return AcquireResult(None, _seconds(retry_in), cast(Kind, _text(held_as)))
        return self._transaction(
            lambda cursor: Transaction(dialect, cursor).acquire(
                key, owner, holder, ttl, mode, writer_wait
            ),
            key=key,
            holder=holder,
        )

    def release_permit(self, key: str, owner: str) -> bool:
        dialect = self.dialect
        if dialect.release_permit_sql:
            rows, _ = self._execute(
                [(dialect.release_permit_sql, (key, owner))], hot=True, idempotent=False, key=key
            )
            released, waited = bool(int(rows[0][0])), False  # the function NOTIFYs itself
        else:
            released, waited = self._transaction(
                lambda cursor: Transaction(dialect, cursor).release(key, owner),
                idempotent=False,
                key=key,
            )
        self._released(key, released, waited)
        self._tick()
        return released

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        dialect = self.dialect
        if dialect.extend_permit_sql:
            rows, _ = self._execute(
                [(dialect.extend_permit_sql, (key, owner, ttl))], hot=True, key=key
            )
            return bool(int(rows[0][0]))
        return self._transaction(
            lambda cursor: Transaction(dialect, cursor).extend(key, owner, ttl), key=key
        )

    def holders(self, key: str) -> list[LockInfo]:
        rows, _ = self._execute([(self.dialect.permit_listing.holders, (key, key))], key=key)
        return [self._info(row, PERMIT_OWNERS.get(row[6], "exclusive")) for row in rows]

    def get(self, key: str) -> LockInfo | None:
        rows, _ = self._execute([(self.dialect.get_sql, (key,))], key=key)
        return self._info(rows[0]) if rows else None

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        listing = self.dialect.permit_listing
        last = ""
        while True:
            rows, _ = self._execute(
                [(self.dialect.page_sql, (last, len(prefix), prefix, PAGE_SIZE))]
            )
            # A gated key's lock stands for its permits: each permit is listed in its place,
            # those of the whole page read with one statement.
            gated = [row[0] for row in rows if row[1] in PERMIT_OWNERS]
            permits: dict[str, list[LockInfo]] = {}
            if gated:
                found, _ = self._execute([(listing.permits_of_keys(len(gated)), gated)])
                for row in found:
                    permits.setdefault(row[0], []).append(self._info(row, PERMIT_OWNERS[row[6]]))
            for row in rows:
                if row[1] in PERMIT_OWNERS:
                    yield from permits.get(row[0], [])
                else:
                    yield self._info(row)
            if len(rows) < PAGE_SIZE:
                return
            last = rows[-1][0]

    def prune(self) -> int:
        """Delete expired rows, PRUNE_BATCH at a time; how many (locks and permits).

        An acquire draws the fence it would insert before it looks for the key's row. Were that
        row deleted in between, the insert would carry a fence lower than the deleted row's; so
        each batch first waits for the acquires in flight to commit (new ones wait for the
        batch), and raises LockStoreUnavailable if that takes more than a second. Permits
        need no guard: their fences are drawn while their key's lock row is held, and that
        row carries the latest of them.
        """
        dialect = self.dialect
        statements: list[Statement] = [
            *((sql, ()) for sql in dialect.prune_guard),
            (dialect.prune_sql, (PRUNE_BATCH,)),
        ]
        unguard: list[Statement] = [(sql, ()) for sql in dialect.prune_unguard]
        pruned = 0
        for batch, after in (
            (statements, unguard),
            ([(dialect.permit_listing.prune, (PRUNE_BATCH,))], []),
        ):
            while True:
                _, count = self._execute(batch, after=after)
                pruned += max(count, 0)
                if count < PRUNE_BATCH:
                    break
        # The lapsed places in lines of waiters go too (not counted: they are no locks).
        if dialect.line is not None and self._has_line():
            while self._execute([(dialect.line.prune, (PRUNE_BATCH,))])[1] >= PRUNE_BATCH:
                pass
        return pruned

    # -- clean-up as part of normal work ---------------------------------------------------
    # Every SWEEP_EVERY acquires and releases a thread runs a sweep round, which deletes free
    # (released or expired) rows without holding acquires off: no table lock, a read that
    # locks nothing, and a delete by key whose row locks an acquire of one of those keys waits
    # for only until that one short statement commits. Fences must still strictly increase per
    # key, and that is what the sweep must not break: where an acquire draws the fence it
    # would insert before it looks for its key's row (PostgreSQL, MariaDB: a sequence in the
    # INSERT's VALUES), deleting the row in between would let the insert carry a fence lower
    # than the deleted row's. So a round (`_sweep`) first draws a mark M from the sequence and
    # then lists the other transactions writing the table (B); a later round, once none of B
    # is writing any more, deletes free rows whose fence is at most M (and draws a new mark).
    #
    # Why no acquire A can then insert a fence F_A below a deleted row R's fence F_R <= M:
    # the sequence hands out increasing values in time order (CACHE 1 on PostgreSQL; MariaDB
    # shares its cache between connections), so F_A < F_R <= M means A drew F_A before M was
    # drawn. A writes the table from before it draws its fence until it commits (PostgreSQL:
    # its ROW EXCLUSIVE table lock, taken before the statement runs; MariaDB: its statement,
    # executing under one QUERY_ID), and it inserts after R was deleted, so it was writing the
    # whole time from before M until after the delete, and the list of B, read after M, named
    # it. The delete ran only after a list showed none of B writing: A had ended before it.
    # The operations that draw fences after locking the key's row (an acquire's update branch,
    # every permit operation) need no mark: a row that is locked is not deleted, and a row
    # deleted before it was locked took its fences with it, all drawn before the new ones.
    # PostgreSQL's permit function re-reads the row until it holds it (migration 0004), so a
    # row deleted between its insert and its read cannot leave it without one.
    # SQLite needs no mark: an acquire computes MAX(fence) + 1 inside its own write, SQLite
    # runs one write at a time, and the sweep keeps the row of the highest fence.
    def _tick(self) -> None:
        """Count one acquire or release of this thread; every SWEEP_EVERY, a sweep round."""
        sweeps = self._sweeps
        sweeps.countdown -= 1
        if sweeps.countdown <= 0:
            sweeps.countdown = SWEEP_EVERY
            try:
                self._sweep(sweeps)
            except Exception as exc:  # the caller's acquire or release succeeded: keep it so
                logger.info("lock store %r: clean-up round failed: %s", self.alias, exc)

    def _sweep(self, sweeps: _Sweeps) -> int:
        """One round of clean-up (see above); how many rows it deleted."""
        dialect = self.dialect
        # Lapsed places in lines of waiters need no mark: they carry no fence.
        line, deleted = dialect.line, 0
        if line is not None and self._has_line():
            deleted = self._sweep_rows(line.sweep_select, (SWEEP_BATCH,), line.sweep_delete, ())
        mark: int | None = None
        if dialect.sweep_mark_sql:
            (drawn,), _ = self._execute([(dialect.sweep_mark_sql, ())])
            busy = {row[0] for row in self._execute([(dialect.sweep_busy_sql, ())])[0]}
            mark = sweeps.mark
            if mark is None or not sweeps.busy.isdisjoint(busy):
                if mark is None:
                    sweeps.mark, sweeps.busy = int(drawn[0]), busy
                return deleted  # no mark yet, or some of its writers still write
            sweeps.mark, sweeps.busy = int(drawn[0]), busy
        # Permits first: those of a key whose lock row goes now wait for the next round, so
        # a key in use between two rounds keeps its slots. Each delete names the rows read
        # just before: the read, which may scan the whole table, holds no lock.
        first = dialect.sweep_params(mark)
        deleted += self._sweep_rows(
            dialect.sweep_permits_select, (SWEEP_BATCH,), dialect.sweep_permits_delete, ()
        )
        deleted += self._sweep_rows(
            dialect.sweep_select, (*first, SWEEP_BATCH), dialect.sweep_delete, first
        )
        return deleted

    def _sweep_rows(
        self,
        select: str,
        select_params: Sequence[Any],
        delete: str,
        delete_params: Sequence[Any],
    ) -> int:
        """Read the rows a sweep may delete (`select`), then delete those (`delete`, which
        rechecks each); how many it deleted."""
        dialect = self.dialect
        rows, _ = self._execute([(select, select_params)])
        if not rows:
            return 0
        sql, names = dialect.sweep_names(delete, [row[0] for row in rows])
        statements = [*((s, ()) for s in dialect.sweep_before), (sql, (*delete_params, *names))]
        _, count = self._execute(statements)
        return max(count, 0)

    def _info(self, row: Row, mode: Kind = "exclusive") -> LockInfo:
        key, owner, holder, fence, acquired_at, remaining = row[:6]
        return LockInfo(
            key=key,
            owner=owner,
            holder=holder,
            fence=int(fence),
            acquired_at=self.dialect.datetime(acquired_at),
            expires_in=max(0.0, float(remaining or 0.0)),
            mode=mode,
        )

    # -- wake-ups -------------------------------------------------------------------------
    def _listens(self) -> bool:
        return self.push_possible and (self.dialect.pushes_releases or self.doorbells() is not None)

    @property
    def push_wakeups(self) -> bool:
        # A doorbell's ring may be missed: waiters woken by them still poll.
        return self.dialect.pushes_releases and self.listener_ready()

    def new_listener(self) -> ReleaseListener:
        return LISTENERS[self.dialect.listener](self)

    def doorbells(self) -> Doorbells | None:
        """Where this machine's processes waiting on this store hang their doorbells (SQLite on
        a file: see `database.doorbells`); None where there are none."""
        if not self.dialect.rings_doorbells:
            return None
        name = connections[self.database].settings_dict["NAME"]
        bells = self._doorbells
        if bells is None or bells.name != name:  # the test runner renames the database
            bells = self._doorbells = Doorbells.of(name)
        return bells

    def _announce(self, key: str) -> None:
        """A release of `key` happened: wake its waiters in this process, and ring the
        doorbells of the others'."""
        self.wake_board.wake(key)
        bells = self.doorbells()
        if bells is not None:
            listener, own = self._listener, None
            if isinstance(listener, DoorbellListener) and listener.pid == os.getpid():
                own = listener.bell_name
            bells.ring(key, skip=own)

    def close(self) -> None:
        self.stop_listener()
        self._threads.close_all()


class _Sweeps(threading.local):
    """Each thread's count to its next sweep round, and the mark its rounds wait on: a fence
    drawn, and the transactions that were writing the table just after (see `_sweep`)."""

    def __init__(self) -> None:
        self.countdown = SWEEP_EVERY
        self.mark: int | None = None
        self.busy: set[Any] = set()


class _ThreadConnection:
    """One thread's connection, the cursor it reuses (not a cursor per call: cheaper), the
    deadline its calls run under and, on PostgreSQL with psycopg 3, its libpq path."""

    __slots__ = ("check", "cursor", "deadline", "libpq", "wrapper")

    def __init__(
        self, wrapper: Any, deadline: Deadline, libpq: PreparedStatements | None = None
    ) -> None:
        self.wrapper, self.cursor, self.libpq = wrapper, wrapper.connection.cursor(), libpq
        self.deadline = deadline
        self.check = SocketCheck()

    def stale(self) -> bool:
        """Whether the server closed this idle connection (see SocketCheck). SQLite has no
        socket and is never stale."""
        fileno = getattr(self.wrapper.connection, "fileno", None)
        if fileno is None:
            return False
        try:
            return self.check.readable(fileno())
        except (OSError, ValueError, self.wrapper.Database.Error):
            return True  # closed already


def _close_connection(conn: _ThreadConnection) -> None:
    _close_raw(conn.wrapper, conn.deadline)


def _close_raw(wrapper: Any, deadline: Deadline) -> None:
    """Close the driver connection itself: Django's close() would refuse to run inside an
    event loop (override_settings in an async test, an ASGI shutdown) and leak it."""
    deadline.detach()  # first: the descriptor may be reused once closed
    raw, wrapper.connection = wrapper.connection, None
    if raw is not None:
        try:
            raw.close()
        except Exception:  # broken already: nothing more to free
            pass


#: SQLSTATEs of a schema object that is not there: a table or sequence (undefined_table), a
#: function (undefined_function, PostgreSQL's semaphores).
_UNDEFINED = frozenset({"42P01", "42883"})
#: MariaDB's "table doesn't exist" (ER_NO_SUCH_TABLE; a sequence is a table there).
_NO_SUCH_TABLE = 1146


def _missing_schema(exc: Exception) -> bool:
    """Whether the driver error `exc` says a table, sequence or function of ours is missing:
    the database was not migrated (a configuration mistake, not an outage)."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)  # psycopg 3, 2
    if sqlstate in _UNDEFINED:
        return True
    if type(exc).__module__.startswith("sqlite3"):
        return str(exc).startswith("no such table")
    return bool(exc.args) and exc.args[0] == _NO_SUCH_TABLE and "MySQL" in type(exc).__module__


def _in_transaction(cursor: Any, begin: str, body: Callable[[Any], T]) -> T:
    """`body(cursor)` between `begin` and COMMIT on the store's own connection."""
    cursor.execute(begin)
    try:
        result = body(cursor)
        cursor.execute("COMMIT")
    except Exception:
        # A data exception keeps the connection (see `_execute`): its transaction must end
        # here. After anything worse the connection is dropped, and the server rolls back.
        with suppress(Exception):
            cursor.execute("ROLLBACK")
        raise
    return result


def _in_savepoint(cursor: Any, body: Callable[[Any], T]) -> T:
    """`body(cursor)` in a savepoint of the caller's open transaction."""
    cursor.execute("SAVEPOINT keel_lock_permit")
    try:
        result = body(cursor)
    except Exception:
        with suppress(Exception):
            cursor.execute("ROLLBACK TO SAVEPOINT keel_lock_permit")
            cursor.execute("RELEASE SAVEPOINT keel_lock_permit")
        raise
    cursor.execute("RELEASE SAVEPOINT keel_lock_permit")
    return result


def _seconds(value: Any) -> float | None:
    return None if value is None else max(0.0, float(value))


def _text(value: Any) -> str | None:
    """A text column's value (the libpq path gives bytes)."""
    return value.decode() if isinstance(value, bytes) else value
