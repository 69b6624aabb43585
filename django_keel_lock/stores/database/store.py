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
  `database.line`), and a release that someone waited for wakes only the first of them; on
  PostgreSQL it hands the lock over to that one in the same statement, and its wake-up
  carries the grant while that waiter's process listens (`PostgresDialect.release_line_sql`).
- What differs by database (its SQL, its wake-ups, its permits, its checks) is its vendor's
  (`vendors`); this class runs statements and keeps what all share.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from functools import cached_property
from typing import Any, TypeVar

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured, SynchronousOnlyOperation
from django.db import connections

from ...exceptions import LockStoreMisconfigured, LockStoreUnavailable
from ..base import PERMIT_OWNERS, AcquireResult, Kind, LockInfo, LockStore, Mode
from ..connections import Deadline, PerThread, SocketCheck, socket_timeout_option
from ..wakeups import ListeningStore, ReleaseListener
from . import checks
from .dialects import Dialect
from .dialects.base import in_transaction
from .doorbells import Doorbells
from .libpq import PreparedStatements, Row, Statement
from .line import Line
from .vendors import VENDORS, ServerVendor, Vendor, check_database

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
T = TypeVar("T")
_Result = tuple[list[Row], int]
#: The key (or keys, of a multi-key operation) an error about a value names.
Keys = str | tuple[str, ...] | None


class DatabaseLockStore(ListeningStore, LockStore):
    """The default store: the `Lock` table in a Django database (OPTIONS: DATABASE, DURABLE,
    SOCKET_TIMEOUT; on PostgreSQL also TRANSACTION_POOLER, LISTEN_DATABASE and CAPPED_GRANTS).

    DURABLE=False (PostgreSQL) skips the commit flush for lock writes: faster, but a database
    crash can forget locks taken in the last moments before it, so two holders may then overlap.

    CAPPED_GRANTS (PostgreSQL, durable stores; default True): this process's waiters take
    capped grants, handed over without waiting for the flush and confirmed by an extend of
    their own (migration 0011; what a crash can then cost: docs/guarantees.md). False: every
    lock handed over to them waits for the flush, as before.

    SOCKET_TIMEOUT (seconds, default 5) is the longest a call waits for the server: to connect
    (whole seconds, the drivers' unit; libpq waits at least 2), to set up a new connection, and
    for a call's statements. A call past it raises LockStoreUnavailable and its connection is
    dropped (see `connections.Deadline`). SQLite has no server to wait for: it ignores it.

    TRANSACTION_POOLER (PostgreSQL): whether DATABASE is reached through a pooler that may run
    each transaction on another server connection (PgBouncer's pool_mode = transaction, RDS
    Proxy, Supavisor's transaction port). None (the default): the store's first connection
    finds out (see `pooler`). Behind one the store keeps nothing on a session.

    LISTEN_DATABASE (PostgreSQL): the DATABASES alias whose connection the listener LISTENs on
    for other processes' releases, where DATABASE cannot keep a session (behind a transaction
    pooler); the same database, reached directly or through session pooling. Default: DATABASE
    itself, except behind a transaction pooler, where waiters then poll.
    """

    max_key_length = 255
    option_names = frozenset(
        {
            "DATABASE",
            "DURABLE",
            "SOCKET_TIMEOUT",
            "TRANSACTION_POOLER",
            "LISTEN_DATABASE",
            "CAPPED_GRANTS",
        }
    )

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
        return [
            *checks.check_tables(on, databases, check_database),
            *checks.check_poolers(stores, databases),
        ]

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
        #: Whether this process's waiters take capped grants (`PostgresListener`).
        self.capped_grants = self.durable and bool(self.options.get("CAPPED_GRANTS", True))
        self.transaction_pooler, self.listen_database = _pooler_options(alias, self.options)
        self.socket_timeout = socket_timeout_option(alias, self.options)
        self._threads: PerThread[_ThreadConnection] = PerThread(_close_connection)
        # False once the driver turned out to have no LISTEN (psycopg2), or SQLite's doorbells
        # could not be set up.
        self.push_possible = True
        self._sweeps = _Sweeps()
        # (key, owner) of this process's waiters that stand in a line: their attempts go
        # straight to the line's transaction (the plain upsert could take the lock out of
        # turn when a take by a non-waiting acquire lowered the flag meanwhile).
        self._in_line: set[tuple[str, str]] = set()

    @property
    def queues(self) -> bool:  # type: ignore[override]
        # Before the first connection tells (`_line`), a wait stands in the line: its
        # attempts find out, and go on as plain acquires where the table is missing.
        vendor = self.vendor
        return isinstance(vendor, ServerVendor) and vendor.line_table is not False

    @property
    def capped_table(self) -> bool | None:
        """Whether the database has migration 0011 (capped grants), as a connection of the
        store found: its releases then read a grant's `good_for` (None: not known yet)."""
        return getattr(self.vendor, "capped_table", None)

    @property
    def hands_off(self) -> bool:  # type: ignore[override]
        # A release hands the lock over to the first in line (PostgreSQL: see
        # `PostgresDialect.release_line_sql`); its next `acquire_queued` takes the grant up.
        vendor = self.vendor
        return isinstance(vendor, ServerVendor) and vendor.hands_off and self.queues

    def _line(self) -> ServerVendor | None:
        """The vendor where this store keeps lines: the vendor has them and the database
        the table. Opens this thread's connection if need be (the first one finds out)."""
        vendor = self.vendor
        if not isinstance(vendor, ServerVendor):
            return None
        if vendor.line_table is None:
            self._open()
        return vendor if vendor.line_table else None

    def _has_line(self) -> bool:
        return self._line() is not None

    # -- connections ----------------------------------------------------------------------
    def _connection_settings(self, database: str | None = None) -> dict[str, Any]:
        """The settings of `database` (ours by default) for a connection of our own: never
        from Django's pool (we would drain it and never give connections back), in autocommit
        whatever the project's AUTOCOMMIT (each lock statement commits on its own, or nobody
        else would see it), psycopg 3 tuned for our few statements, MariaDB in utf8mb4."""
        base = connections[database or self.database]
        settings = dict(base.settings_dict, AUTOCOMMIT=True)
        options = dict(settings.get("OPTIONS") or {})
        options.pop("pool", None)
        if base.vendor in VENDORS:
            self.dialect.connection_options(options, base, self.socket_timeout)
        settings["OPTIONS"] = options
        return settings

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
            if wrapper.vendor in VENDORS:
                self.vendor.set_up(wrapper.connection, self.durable)
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
        libpq = self.vendor.fast_path(wrapper)
        return self._threads.put(_ThreadConnection(wrapper, deadline, libpq)), True

    @cached_property
    def vendor(self) -> Vendor:
        """The store's ways on its database's vendor (see `vendors`). Cached in the instance:
        every call reads it, at the cost of an attribute."""
        name = connections[self.database].vendor
        if name not in VENDORS:
            raise LockStoreUnavailable(
                f"DatabaseLockStore supports PostgreSQL, MariaDB and SQLite, "
                f"not {name!r} (database {self.database!r})"
            )
        return VENDORS[name](self)

    @property
    def dialect(self) -> Dialect:
        """The SQL of the store's database (its vendor's)."""
        return self.vendor.dialect

    def execute(
        self,
        statements: Sequence[Statement],
        *,
        hot: bool = False,
        idempotent: bool = True,
        after: Sequence[Statement] = (),
        key: Keys = None,
        holder: str | None = None,
        answered: bool = False,
    ) -> tuple[list[Row], int]:
        """Run `statements` in autocommit, then `after` on the same connection (what closes
        prune's guard); (rows, rowcount) of the last run (`answered`: the first with rows).

        `hot` statements (acquire, release, extend: they return only numbers) take the
        connection's libpq path where it has one: values may be bytes (int(), float() read them).

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

        Where the dialect says so (SQLite in the caller's transaction), they run on the
        caller's own connection instead, once, and leave it open whatever happens.

        The statements (and `after`) wait at most SOCKET_TIMEOUT for the server, together;
        if they get no reply in time, no retry: the server would make the caller wait again.
        """
        assert not (hot and after), "the libpq path runs no closing statements"
        conn = self._threads.get() if hot else None
        if conn is not None and conn.libpq is not None and (idempotent or not conn.stale()):
            # `run`'s first attempt inline, by its rules (`_failed`): a good part of a lock
            # statement's time on this thread's open connection. Only PostgreSQL's have a
            # libpq path, and never join the caller's transaction (`callers_transaction`).
            libpq, database = conn.libpq, conn.database
            result: _Result = ([], 0)
            conn.deadline.arm()
            try:
                for sql, params in statements:
                    result = libpq.one(sql, params, database.OperationalError)
                    if answered and result[0]:
                        break
            except database.Error as exc:
                self._failed(exc, conn, True, idempotent, False, key, holder)
                return self._execute_by_run(
                    statements, hot, idempotent, after, key, holder, answered
                )
            except BaseException:
                self._abandon(conn)
                raise
            self._settled(conn)
            return result
        return self._execute_by_run(statements, hot, idempotent, after, key, holder, answered)

    def _execute_by_run(
        self,
        statements: Sequence[Statement],
        hot: bool,
        idempotent: bool,
        after: Sequence[Statement],
        key: Keys,
        holder: str | None,
        answered: bool = False,
    ) -> _Result:
        """`execute` through `run`: on a new connection, or any but the libpq path."""

        def work(cursor: Any, libpq: PreparedStatements | None, database: Any) -> _Result:
            if hot and libpq is not None:
                return libpq.execute(statements, database.OperationalError, answered)
            result: _Result = ([], 0)
            for sql, params in statements:
                cursor.execute(sql, params)
                result = (cursor.fetchall() if cursor.description else []), cursor.rowcount
                if answered and result[0]:
                    break
            for sql, params in after:
                cursor.execute(sql, params)
            return result

        return self.run(work, idempotent=idempotent, closing=bool(after), key=key, holder=holder)

    def transaction(
        self,
        body: Callable[[Any], T],
        *,
        idempotent: bool = True,
        key: Keys = None,
        holder: str | None = None,
    ) -> T:
        """`body(cursor)` inside one transaction (the dialect's `begin_sql` ... COMMIT), by
        `_execute`'s rules. Inside the caller's transaction (SQLite), in a savepoint of it
        instead: a failure midway leaves the caller's transaction as it was."""
        return self.run(body, transaction=True, idempotent=idempotent, key=key, holder=holder)

    def run(
        self,
        work: Callable[..., T],
        *,
        transaction: bool = False,
        idempotent: bool = True,
        closing: bool = False,
        key: Keys = None,
        holder: str | None = None,
    ) -> T:
        """What `_execute` and `_transaction` share: `work(cursor, libpq, driver)` (or, in a
        `transaction`, `work(cursor)`) with the deadline, retry and error rules `_execute`
        states. `closing`: work ends by closing a guard, so even a data exception drops the
        connection."""
        joined = self.vendor.callers_transaction(self.database)
        if joined is not None:
            return self._run_joined(joined, work, transaction, key, holder)
        for attempt in (1, 2):
            conn, fresh = self._open()
            if not idempotent and not fresh and conn.stale():
                self._threads.drop()
                conn, fresh = self._open()
            database = conn.database
            conn.deadline.arm()
            try:
                if transaction:
                    result = in_transaction(conn.cursor, self.dialect.begin_sql, work)
                else:
                    result = work(conn.cursor, conn.libpq, database)
            except database.Error as exc:
                again = attempt == 1 and idempotent and not fresh
                self._failed(exc, conn, attempt == 1, again, closing, key, holder)
                continue
            except BaseException:
                self._abandon(conn)
                raise
            self._settled(conn)
            return result
        raise AssertionError("unreachable")

    def _failed(
        self,
        exc: Exception,
        conn: _ThreadConnection,
        first: bool,
        again: bool,
        closing: bool,
        key: Keys,
        holder: str | None,
    ) -> None:
        """After the driver error `exc` of a call on `conn` (the `first` attempt or not):
        raise what the caller gets, or return where the call goes again on a new connection
        (`again`: it may, having failed on a connection that was not new; or the statement
        did not run, see `Vendor.lost_session`). `closing`: as in `run`."""
        timed_out = conn.deadline.disarm()
        if isinstance(exc, conn.database.DataError) and not closing and not timed_out:
            raise self._refused(exc, key, holder) from exc
        self._threads.drop()
        if timed_out:
            raise self._timed_out() from exc
        if _missing_schema(exc):
            raise self._not_migrated(exc) from exc
        if first and self.vendor.lost_session(exc):
            return  # it did not run: again, on a connection set up for that
        if not again:
            raise LockStoreUnavailable(
                f"lock store {self.alias!r} (database {self.database!r}) failed: {exc}"
            ) from exc

    def _settled(self, conn: _ThreadConnection) -> None:
        """After a call on `conn` returned: drop it if the reply made it just as its deadline
        cut the socket."""
        if conn.deadline.disarm():
            self._threads.drop()

    def _abandon(self, conn: _ThreadConnection) -> None:
        """Drop `conn` after an exception other than the driver's (a task's time limit,
        Ctrl-C), and with it whatever it was in the middle of."""
        conn.deadline.disarm()
        self._threads.drop()

    def _run_joined(
        self,
        raw: Any,
        work: Callable[..., T],
        transaction: bool,
        key: Keys,
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

    def _refused(self, exc: Exception, key: Keys, holder: str | None) -> ValueError:
        if key is None:
            what = "a value"
        elif isinstance(key, str):
            what = f"key {key!r}"
        else:
            what = f"one of keys {list(key)!r}"
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
        vendor = self.vendor
        retake = vendor.retake(key, owner, holder, ttl)
        if retake is None:
            result = self._upsert(vendor.dialect.acquire_sql, key, owner, holder, ttl)
        else:  # the retake, then the upsert where it took nothing: one call, one deadline
            rows, _ = self.execute(retake, hot=True, key=key, holder=holder, answered=True)
            fence = rows[0][0] if rows else None  # the retake's fence, or the upsert's
            result = AcquireResult(int(fence)) if fence is not None else self._acquired(rows, key)
        self._tick()
        return result

    def _upsert(
        self, statements: Sequence[str], key: str, owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        """Run an acquire upsert (`acquire_sql` or `acquire_queued_sql`): its result."""
        params = self.vendor.dialect.acquire_params(key, owner, holder, ttl)
        rows, _ = self.execute(
            list(zip(statements, params, strict=True)), hot=True, key=key, holder=holder
        )
        return self._acquired(rows, key)

    def _acquired(self, rows: list[Row], key: str) -> AcquireResult:
        """The result of an acquire upsert (or a retake) of `key` that returned `rows`."""
        if not rows:
            rows = self.vendor.refused(key)
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
        vendor = self._line()
        if vendor is None:
            if not isinstance(self.vendor, ServerVendor):
                return super().acquire_queued(key, owner, holder, ttl)
            return self.acquire(key, owner, holder, ttl)  # a database without the table
        self._tick()
        dialect = vendor.dialect
        if (key, owner) not in self._in_line:
            # Not in the line yet: as cheap as acquire while nobody waits (PostgreSQL: one
            # statement, by libpq). Refused by permits: not queued.
            result = self._upsert(dialect.acquire_queued_sql, key, owner, holder, ttl)
            if result.acquired or (result.held_as != "exclusive" and result.retry_in):
                return result
        else:
            # In the line already, as a rule woken as its first: one statement if it is.
            params = {"owner": owner, "holder": holder, "ttl": dialect.interval(ttl), "key": key}

            def take(cursor: Any, libpq: Any, database: Any) -> int | None:
                cursor.execute(dialect.take_first_sql, params)
                return dialect.taken_fence(cursor)

            fence = self.run(take, key=key, holder=holder)
            if fence is not None:
                self._in_line.discard((key, owner))
                return AcquireResult(fence)
        address = self.wake_address
        # Where it listens (PostgreSQL: its backend's pid), so that a release carries a
        # grant to this process only while that connection is there.
        listener = getattr(self._listener, "backend_pid", None) if address else None
        result, queued = self.transaction(
            lambda cursor: Line(dialect, cursor).acquire(
                key, owner, holder, ttl, address, listener
            ),
            key=key,
            holder=holder,
        )
        if queued:
            self._in_line.add((key, owner))
        else:
            self._in_line.discard((key, owner))
        return result

    def leave_queue(self, key: str, owner: str) -> None:
        vendor = self.vendor
        if not isinstance(vendor, ServerVendor):
            return super().leave_queue(key, owner)
        if (key, owner) not in self._in_line:
            return  # never joined (or its place was given up already)
        self._in_line.discard((key, owner))
        vendor.leave_line(key, owner)

    def release(self, key: str, owner: str) -> bool:
        vendor = self.vendor
        # Read straight where the first connection has told (`_line` finds out otherwise).
        line = getattr(vendor, "line_table", False)
        released = vendor.release(key, owner, line=self._has_line() if line is None else line)
        self._out_of_line(key, owner)
        self._tick()
        return released

    def _out_of_line(self, key: str, owner: str) -> None:
        """`owner` released `key`: it stands in no line of it. A waiter that took a grant its
        wake-up carried made no call, so this is where the store learns it left the line
        (else one entry per such hand-off stayed in `_in_line` for ever)."""
        if self._in_line:
            self._in_line.discard((key, owner))

    def release_by(self, key: str, owner: str, statement: Callable[[bool], Statement]) -> list[Row]:
        """Run `statement(line)`, one (built by `results`) that releases `owner`'s `key` as
        `release` does (`line`: the database has the line's table, whose first waiter it
        wakes) and does more, in autocommit and never retried (as a release); its rows, the
        first of which begins with how many locks it released (none: nothing released).
        This process's waiters are then woken as a release wakes them."""
        rows, _ = self.execute([statement(self._has_line())], idempotent=False, key=key)
        self.vendor.released(key, bool(rows) and int(rows[0][0]) > 0, False)
        self._out_of_line(key, owner)
        self._tick()
        return rows

    # -- several keys: one call (PostgreSQL) or one transaction (see `vendors`) ------------
    atomic_many = True

    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        result = self.vendor.acquire_many(keys, owner, holder, ttl)
        self._tick()
        return result

    def release_many(self, keys: tuple[str, ...], owner: str) -> bool:
        released = self.vendor.release_many(keys, owner, line=self._has_line())
        self._tick()
        return released

    def extend_many(self, keys: tuple[str, ...], owner: str, ttl: float) -> bool:
        return self.vendor.extend_many(keys, owner, ttl)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        dialect = self.dialect
        _, count = self.execute(
            [(dialect.extend_sql, dialect.extend_params(key, owner, ttl))], hot=True, key=key
        )
        return count > 0

    # -- permits: each vendor decides them (see `vendors`) ---------------------------------
    supports_modes = True

    def acquire_permit(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float = 0
    ) -> AcquireResult:
        self._tick()
        return self.vendor.acquire_permit(key, owner, holder, ttl, mode, writer_wait)

    def release_permit(self, key: str, owner: str) -> bool:
        vendor = self.vendor
        released, waited = vendor.release_permit(key, owner)
        vendor.released(key, released, waited)
        self._tick()
        return released

    def extend_permit(self, key: str, owner: str, ttl: float) -> bool:
        return self.vendor.extend_permit(key, owner, ttl)

    def holders(self, key: str) -> list[LockInfo]:
        rows, _ = self.execute([(self.dialect.permit_listing.holders, (key, key))], key=key)
        return [self._info(row, PERMIT_OWNERS.get(row[6], "exclusive")) for row in rows]

    def get(self, key: str) -> LockInfo | None:
        rows, _ = self.execute([(self.dialect.get_sql, (key,))], key=key)
        return self._info(rows[0]) if rows else None

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        listing = self.dialect.permit_listing
        last = ""
        while True:
            rows, _ = self.execute(
                [(self.dialect.page_sql, (last, len(prefix), prefix, PAGE_SIZE))]
            )
            # A gated key's lock stands for its permits: each permit is listed in its place,
            # those of the whole page read with one statement.
            gated = [row[0] for row in rows if row[1] in PERMIT_OWNERS]
            permits: dict[str, list[LockInfo]] = {}
            if gated:
                found, _ = self.execute([(listing.permits_of_keys(len(gated)), gated)])
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
                _, count = self.execute(batch, after=after)
                pruned += max(count, 0)
                if count < PRUNE_BATCH:
                    break
        # The lapsed places in lines of waiters go too (not counted: they are no locks).
        lined = self._line()
        if lined is not None:
            while self.execute([(lined.dialect.line.prune, (PRUNE_BATCH,))])[1] >= PRUNE_BATCH:
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
        lined, deleted = self._line(), 0
        if lined is not None:
            line = lined.dialect.line
            deleted = self._sweep_rows(line.sweep_select, (SWEEP_BATCH,), line.sweep_delete, ())
        first = self.vendor.sweep_params(sweeps)
        if first is None:
            return deleted
        # Permits first: those of a key whose lock row goes now wait for the next round, so
        # a key in use between two rounds keeps its slots. Each delete names the rows read
        # just before: the read, which may scan the whole table, holds no lock.
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
        rows, _ = self.execute([(select, select_params)])
        if not rows:
            return 0
        sql, names = dialect.sweep_names(delete, [row[0] for row in rows])
        statements = [*((s, ()) for s in dialect.sweep_before), (sql, (*delete_params, *names))]
        _, count = self.execute(statements)
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

    # -- wake-ups: each vendor's own (see `vendors`) ------------------------------------
    def _listens(self) -> bool:
        vendor = self.vendor
        return self.push_possible and (vendor.pushes_releases or vendor.doorbells() is not None)

    @property
    def push_wakeups(self) -> bool:
        # A doorbell's ring may be missed: waiters woken by them still poll.
        return self.vendor.pushes_releases and self.listener_ready()

    def new_listener(self) -> ReleaseListener:
        return self.vendor.listener(self)

    @property
    def release_listener(self) -> ReleaseListener | None:
        """This process's listener, if one was started (a forked child's is its parent's)."""
        return self._listener

    def doorbells(self) -> Doorbells | None:
        """Where this machine's processes waiting on this store hang their doorbells (SQLite on
        a file: see `database.doorbells`); None where there are none."""
        return self.vendor.doorbells()

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

    __slots__ = ("check", "cursor", "database", "deadline", "libpq", "wrapper")

    def __init__(
        self, wrapper: Any, deadline: Deadline, libpq: PreparedStatements | None = None
    ) -> None:
        self.wrapper, self.cursor, self.libpq = wrapper, wrapper.connection.cursor(), libpq
        self.database = wrapper.Database  # the driver module: its errors
        self.deadline = deadline
        self.check = SocketCheck()

    def stale(self) -> bool:
        """Whether the server closed this idle connection (see SocketCheck), by the socket
        its deadline watches (the connection's, for its whole life). SQLite has no socket
        and is never stale."""
        fileno = self.deadline.fileno
        if fileno < 0:
            return False
        check = self.check
        try:
            if fileno != check.fileno:
                return check.readable(fileno)
            return bool(check.poller.poll(0))  # `readable`, one call less on every release
        except (OSError, ValueError):
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


def _pooler_options(alias: str, options: Mapping[str, Any]) -> tuple[bool | None, str | None]:
    """OPTIONS TRANSACTION_POOLER (None, True or False) and LISTEN_DATABASE (None or a
    DATABASES alias), checked."""
    pooled = options.get("TRANSACTION_POOLER")
    if pooled is not None and not isinstance(pooled, bool):
        raise ImproperlyConfigured(
            f"KEEL_LOCK_STORES[{alias!r}] OPTIONS TRANSACTION_POOLER must be True, False or "
            f"None (find out), got {pooled!r}"
        )
    listen = options.get("LISTEN_DATABASE")
    if listen is not None and listen not in connections.settings:
        raise ImproperlyConfigured(
            f"KEEL_LOCK_STORES[{alias!r}] OPTIONS LISTEN_DATABASE {listen!r} is not in "
            f"DATABASES (configured: {', '.join(connections.settings)})"
        )
    return pooled, listen


def _missing_schema(exc: Exception) -> bool:
    """Whether the driver error `exc` says a table, sequence or function of ours is missing:
    the database was not migrated (a configuration mistake, not an outage)."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)  # psycopg 3, 2
    if sqlstate in _UNDEFINED:
        return True
    if type(exc).__module__.startswith("sqlite3"):
        return str(exc).startswith("no such table")
    return bool(exc.args) and exc.args[0] == _NO_SUCH_TABLE and "MySQL" in type(exc).__module__


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
