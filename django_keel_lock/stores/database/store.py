"""Locks in the `Lock` table, shared by every process and server that shares the database.

Three rules shape this module:
- The database's clock decides expiry; the app server's clock is never read.
- Locks live outside the caller's transaction: each thread gets its own autocommit connection,
  so a lock taken inside `atomic()` is visible at once and survives the caller's rollback.
- One statement per operation (MariaDB: two for acquire), talking to the driver directly; on
  PostgreSQL with psycopg 3, acquire, release and extend go straight to libpq as statements
  prepared once per connection, skipping the cursor layer (about 40 µs a statement).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured, SynchronousOnlyOperation
from django.db import connections

from ...exceptions import LockStoreUnavailable
from ..base import AcquireResult, LockInfo, LockStore, PerThread, ReleaseListener, SocketCheck

logger = logging.getLogger("django_keel_lock")

TABLE = "django_keel_lock_lock"
SEQUENCE = "django_keel_lock_fence"
# A release NOTIFYs on its key's own channel: CHANNEL_PREFIX + md5(key), a valid identifier
# whatever the key, so a process LISTENs only to the keys it waits for.
CHANNEL_PREFIX = "keel_lock_"
PAGE_SIZE = 1000
PRUNE_BATCH = 1000
# The listener checks its connection after this many quiet seconds.
LISTEN_PING = 5.0
# libpq settings of the listener's connection (the project's own win): its ping, or keepalives
# while quiet, fail within about ten seconds on a link that died silently, not after TCP's
# ~15 minutes of retransmissions, in which waiters would trust wake-ups that never come.
LISTEN_TCP = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}

Row = Sequence[Any]


class Dialect:
    """The SQL one database speaks. Placeholders are the driver's own (%s, or ? for SQLite)."""

    vendor = ""
    acquire_sql: Sequence[str] = ()  # run in order; the last one's first row is (fence, retry_in)
    release_sql = ""
    extend_sql = ""
    get_sql = ""
    page_sql = ""
    prune_sql = ""  # deletes at most %s expired rows
    # Run before and after each prune batch: they hold off every acquire in flight (see
    # DatabaseLockStore.prune), and give up after a second rather than stall acquires longer.
    prune_guard: Sequence[str] = ()
    prune_unguard: Sequence[str] = ()

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        raise NotImplementedError

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (ttl, key, owner)

    def datetime(self, value: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if isinstance(value, datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value  # type: ignore[no-any-return]


# Columns every reading query returns, in this order.
_INFO = "key, owner, holder, fence, acquired_at, {remaining}"


class PostgresDialect(Dialect):
    vendor = "postgresql"
    _remaining = "EXTRACT(EPOCH FROM (expires_at - clock_timestamp()))::float8"
    # One upsert whose DO UPDATE branch always writes the row it locked: it either takes it (free:
    # expired, or already ours) or raises its `waiting` flag. Only a release that finds the flag
    # raised NOTIFYs, so a lock nobody waits for is released without one (NOTIFY serialises
    # every notifying commit in the cluster). The flag is lowered when another owner takes the
    # row; the waiters that then still wait were woken by the release before, fail again and
    # raise it again. NULL (rows written before the column existed) counts as lowered.
    # "Now" is read once, as EXCLUDED.acquired_at, so every CASE agrees on whether the row was
    # free (a later clock read could disagree). The owner column then tells what happened: ours
    # (the new fence) or someone else's (seconds left on their lock).
    # No CTE, no second statement: the plan is as cheap as a plain UPDATE's.
    _free = "(l.expires_at <= EXCLUDED.acquired_at OR l.owner = EXCLUDED.owner)"
    acquire_sql = (
        f"""
        INSERT INTO {TABLE} AS l (key, owner, holder, fence, acquired_at, expires_at)
        VALUES (%s, %s, %s, nextval('{SEQUENCE}'), clock_timestamp(),
                clock_timestamp() + make_interval(secs => %s))
        ON CONFLICT (key) DO UPDATE SET
            owner = CASE WHEN {_free} THEN EXCLUDED.owner ELSE l.owner END,
            holder = CASE WHEN {_free} THEN EXCLUDED.holder ELSE l.holder END,
            fence = CASE WHEN {_free} THEN nextval('{SEQUENCE}') ELSE l.fence END,
            acquired_at = CASE WHEN {_free} THEN EXCLUDED.acquired_at ELSE l.acquired_at END,
            expires_at = CASE WHEN {_free} THEN EXCLUDED.expires_at ELSE l.expires_at END,
            waiting = CASE WHEN {_free} THEN l.waiting AND l.owner = EXCLUDED.owner ELSE true END
        RETURNING CASE WHEN owner = %s THEN fence END,
                  CASE WHEN owner <> %s THEN {_remaining} END
        """,
    )
    # Release marks the row expired rather than deleting it, so the next acquirer goes through
    # the UPDATE branch and draws its fence after it holds the row lock.
    release_sql = f"""
        UPDATE {TABLE} SET expires_at = clock_timestamp()
        WHERE key = %s AND owner = %s AND expires_at > clock_timestamp()
        RETURNING CASE WHEN waiting IS TRUE THEN pg_notify('{CHANNEL_PREFIX}' || md5(key), '') END
    """
    extend_sql = f"""
        UPDATE {TABLE}
        SET expires_at = GREATEST(expires_at, clock_timestamp() + make_interval(secs => %s))
        WHERE key = %s AND owner = %s AND expires_at > clock_timestamp()
    """
    get_sql = (
        f"SELECT {_INFO.format(remaining=_remaining)} FROM {TABLE} "
        "WHERE key = %s AND expires_at > clock_timestamp()"
    )
    page_sql = (
        f"SELECT {_INFO.format(remaining=_remaining)} FROM {TABLE} "
        "WHERE key > %s AND left(key, %s) = %s AND expires_at > clock_timestamp() "
        "ORDER BY key LIMIT %s"
    )
    prune_sql = (
        f"DELETE FROM {TABLE} WHERE key IN "
        f"(SELECT key FROM {TABLE} WHERE expires_at <= clock_timestamp() LIMIT %s)"
    )
    # SHARE ROW EXCLUSIVE conflicts with the ROW EXCLUSIVE lock every acquire holds from before
    # it draws its fence until it commits, and with another prune's.
    prune_guard = (
        "BEGIN",
        "SET LOCAL lock_timeout = '1s'",
        f"LOCK TABLE {TABLE} IN SHARE ROW EXCLUSIVE MODE",
    )
    prune_unguard = ("COMMIT",)

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, ttl, owner, owner)]


class MySQLDialect(Dialect):
    """MariaDB (10.3+: sequences). Acquire is an upsert plus a read of the row."""

    vendor = "mysql"
    _now = "UTC_TIMESTAMP(6)"
    _remaining = f"TIMESTAMPDIFF(MICROSECOND, {_now}, expires_at) / 1000000.0"
    _free = f"(expires_at <= {_now} OR owner = VALUES(owner))"
    # MySQL applies SET assignments left to right, so `owner` and `expires_at` (which the
    # condition reads) come last and `expires_at` sees the already-updated owner.
    acquire_sql = (
        f"""
        INSERT INTO {TABLE} (`key`, owner, holder, fence, acquired_at, expires_at)
        VALUES (%s, %s, %s, NEXTVAL({SEQUENCE}), {_now}, {_now} + INTERVAL %s MICROSECOND)
        ON DUPLICATE KEY UPDATE
            holder = IF({_free}, VALUES(holder), holder),
            fence = IF({_free}, NEXTVAL({SEQUENCE}), fence),
            acquired_at = IF({_free}, VALUES(acquired_at), acquired_at),
            owner = IF({_free}, VALUES(owner), owner),
            expires_at = IF(owner = VALUES(owner), VALUES(expires_at), expires_at)
        """,
        f"SELECT IF(owner = %s, fence, NULL), IF(owner = %s, NULL, {_remaining}) "
        f"FROM {TABLE} WHERE `key` = %s",
    )
    release_sql = (
        f"UPDATE {TABLE} SET expires_at = {_now} "
        f"WHERE `key` = %s AND owner = %s AND expires_at > {_now}"
    )
    extend_sql = f"""
        UPDATE {TABLE}
        SET expires_at = GREATEST(expires_at, {_now} + INTERVAL %s MICROSECOND)
        WHERE `key` = %s AND owner = %s AND expires_at > {_now}
    """
    get_sql = (
        f"SELECT `key`, owner, holder, fence, acquired_at, {_remaining} FROM {TABLE} "
        f"WHERE `key` = %s AND expires_at > {_now}"
    )
    page_sql = (
        f"SELECT `key`, owner, holder, fence, acquired_at, {_remaining} FROM {TABLE} "
        f"WHERE `key` > %s AND LEFT(`key`, %s) = %s AND expires_at > {_now} "
        "ORDER BY `key` LIMIT %s"
    )
    prune_sql = f"DELETE FROM {TABLE} WHERE expires_at <= {_now} LIMIT %s"
    # A WRITE table lock waits for the metadata lock every acquire holds from before it draws
    # its fence until it commits (LOCK TABLES needs that privilege; ALL PRIVILEGES has it).
    prune_guard = (
        "SET @keel_lock_wait = @@SESSION.lock_wait_timeout, SESSION lock_wait_timeout = 1",
        f"LOCK TABLES {TABLE} WRITE",
    )
    prune_unguard = ("UNLOCK TABLES", "SET SESSION lock_wait_timeout = @keel_lock_wait")

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, round(ttl * 1_000_000)), (owner, owner, key)]

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (round(ttl * 1_000_000), key, owner)


class SQLiteDialect(Dialect):
    """SQLite serialises writers, so MAX(fence) + 1 inside the upsert is race-free."""

    vendor = "sqlite"
    _now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    _remaining = "(julianday(expires_at) - julianday('now')) * 86400.0"
    _next_fence = f"(SELECT COALESCE(MAX(fence), 0) + 1 FROM {TABLE})"
    acquire_sql = (
        f"""
        INSERT INTO {TABLE} AS l (key, owner, holder, fence, acquired_at, expires_at)
        VALUES (?, ?, ?, {_next_fence}, {_now},
                strftime('%Y-%m-%d %H:%M:%f', 'now', ?))
        ON CONFLICT (key) DO UPDATE SET
            owner = excluded.owner, holder = excluded.holder, fence = {_next_fence},
            acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
        WHERE l.expires_at <= {_now} OR l.owner = excluded.owner
        RETURNING fence, NULL
        """,
    )
    release_sql = (
        f"UPDATE {TABLE} SET expires_at = {_now} "
        f"WHERE key = ? AND owner = ? AND expires_at > {_now}"
    )
    extend_sql = f"""
        UPDATE {TABLE}
        SET expires_at = max(expires_at, strftime('%Y-%m-%d %H:%M:%f', 'now', ?))
        WHERE key = ? AND owner = ? AND expires_at > {_now}
    """
    get_sql = (
        f"SELECT {_INFO.format(remaining=_remaining)} FROM {TABLE} "
        f"WHERE key = ? AND expires_at > {_now}"
    )
    page_sql = (
        f"SELECT {_INFO.format(remaining=_remaining)} FROM {TABLE} "
        f"WHERE key > ? AND substr(key, 1, ?) = ? AND expires_at > {_now} ORDER BY key LIMIT ?"
    )
    # The row with the highest fence stays: MAX(fence) + 1 must never go back. No guard: an
    # acquire computes its fence inside its own write, and SQLite runs one write at a time.
    prune_sql = (
        f"DELETE FROM {TABLE} WHERE key IN (SELECT key FROM {TABLE} WHERE expires_at <= {_now} "
        f"AND fence < (SELECT MAX(fence) FROM {TABLE}) LIMIT ?)"
    )

    @staticmethod
    def _modifier(ttl: float) -> str:
        return f"+{ttl:.3f} seconds"

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, self._modifier(ttl))]

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (self._modifier(ttl), key, owner)


DIALECTS: dict[str, type[Dialect]] = {
    "postgresql": PostgresDialect,
    "mysql": MySQLDialect,
    "sqlite": SQLiteDialect,
}


class DatabaseLockStore(LockStore):
    """The default store: the `Lock` table in a Django database (OPTIONS: DATABASE, DURABLE).

    DURABLE=False (PostgreSQL) skips the commit flush for lock writes: faster, but a database
    crash can forget locks taken in the last moments before it, so two holders may then overlap.
    """

    max_key_length = 255
    option_names = frozenset({"DATABASE", "DURABLE"})

    def __init__(self, alias: str = "default", options: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, options)
        self.database: str = self.options.get("DATABASE", "default")
        if self.database not in connections.settings:
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES[{alias!r}] OPTIONS DATABASE {self.database!r} is not in "
                f"DATABASES (configured: {', '.join(connections.settings)})"
            )
        self.durable = bool(self.options.get("DURABLE", True))
        self._threads: PerThread[_ThreadConnection] = PerThread(_close_connection)
        self.push_possible = True  # False once the driver turned out to have no LISTEN (psycopg2)

    # -- connections ----------------------------------------------------------------------
    def _connection_settings(self) -> dict[str, Any]:
        """The database's settings for a connection of our own: never from Django's pool
        (we would drain it and never give connections back), psycopg 3 tuned for our few
        statements, MariaDB in utf8mb4."""
        base = connections[self.database]
        settings = dict(base.settings_dict)
        options = dict(settings.get("OPTIONS") or {})
        options.pop("pool", None)
        if base.vendor == "postgresql" and _is_psycopg3(base):
            # Server-side binding lets psycopg prepare our statements once per connection, so
            # the server stops re-planning them; a user's own choice (pgbouncer) wins.
            options.setdefault("server_side_binding", True)
            options.setdefault("prepare_threshold", 2)
        if base.vendor == "mysql":
            from MySQLdb.constants.CLIENT import FOUND_ROWS

            # Keys may hold any Unicode character: talk utf8mb4 whatever the project's charset.
            options["charset"] = "utf8mb4"
            # Rows matched, not rows changed: an extend that leaves expires_at as it was still
            # counts (Django asks for this flag, but a client_flag in OPTIONS replaces it).
            options["client_flag"] = int(options.get("client_flag", 0)) | FOUND_ROWS
        settings["OPTIONS"] = options
        return settings

    def _direct_possible(self, settings: Mapping[str, Any]) -> bool:
        """Whether the hot statements may be prepared once per connection and run through
        libpq itself: psycopg 3, and prepared statements not turned off (pgbouncer in
        transaction mode needs `"prepare_threshold": None`)."""
        base = connections[self.database]
        options = settings.get("OPTIONS") or {}
        return (
            base.vendor == "postgresql"
            and _is_psycopg3(base)
            and options.get("prepare_threshold") is not None
        )

    def _new_wrapper(self) -> Any:
        base = connections[self.database]
        wrapper = type(base)(self._connection_settings(), self.database)
        # We keep one connection per thread ourselves; sharing is allowed only so close() and
        # the end of a thread can shut it from another thread.
        wrapper.inc_thread_sharing()
        wrapper.ensure_connection()
        if wrapper.vendor == "postgresql":
            with wrapper.connection.cursor() as cursor:
                # Our statements rely on READ COMMITTED (an upsert locks and rereads the
                # row's latest version). Autocommit statements run at the session default,
                # which a server or role may set to SERIALIZABLE: contention would then fail.
                cursor.execute(
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
                )
                if not self.durable:
                    cursor.execute("SET synchronous_commit TO OFF")
        return wrapper

    def _connection(self) -> tuple[_ThreadConnection, bool]:
        """This thread's own autocommit connection; True if it was opened just now."""
        conn = self._threads.get()
        if conn is not None:
            return conn, False
        wrapper = self._new_wrapper()
        direct = (
            _Direct(wrapper.connection.pgconn)
            if self._direct_possible(wrapper.settings_dict)
            else None
        )
        return self._threads.put(_ThreadConnection(wrapper, direct)), True

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
        statements: Sequence[tuple[str, Sequence[Any]]],
        hot: bool = False,
        result_of: int = -1,
        idempotent: bool = True,
    ) -> tuple[list[Row], int]:
        """Run statements in autocommit; (rows, rowcount) of the last (or of `result_of`).

        `hot` statements (acquire, release, extend: they return only numbers) take the
        connection's direct libpq path where it has one; their values may then come back as
        bytes, which int() and float() read alike.

        A statement that failed after it was sent may still have run. Idempotent operations
        (all but release, for the same owner) are then retried once on a fresh connection: the
        server restarted, or a proxy dropped an idle one. A release retried after its commit
        would find the lock gone and report it lost, so it is never retried; it goes out only
        on a connection with nothing unread (one the server closed has an error or EOF
        waiting), replaced first if need be. Any other failure is LockStoreUnavailable. Any
        other exception (a task's time limit, Ctrl-C) drops the connection, and with it
        whatever it was in the middle of, such as a prune's open transaction.
        """
        for attempt in (1, 2):
            conn, fresh = self._open()
            if not idempotent and not fresh and conn.stale():
                self._threads.drop()
                conn, fresh = self._open()
            database = conn.wrapper.Database
            try:
                if hot and conn.direct is not None:
                    return conn.direct.execute(statements, database.OperationalError)
                cursor = conn.cursor
                wanted = range(len(statements))[result_of]
                for index, (sql, params) in enumerate(statements):
                    cursor.execute(sql, params)
                    if index == wanted:
                        result = (cursor.fetchall() if cursor.description else []), cursor.rowcount
                return result
            except database.Error as exc:
                self._threads.drop()
                if fresh or attempt == 2 or not idempotent:
                    raise LockStoreUnavailable(
                        f"lock store {self.alias!r} (database {self.database!r}) failed: {exc}"
                    ) from exc
            except BaseException:
                self._threads.drop()
                raise
        raise AssertionError("unreachable")

    def _open(self) -> tuple[_ThreadConnection, bool]:
        """`_connection()`, a failure to connect being LockStoreUnavailable."""
        try:
            return self._connection()
        except SynchronousOnlyOperation:
            raise  # a programming error (sync call in async code), not an outage
        except Exception as exc:
            raise LockStoreUnavailable(
                f"lock store {self.alias!r} cannot connect to database {self.database!r}: {exc}"
            ) from exc

    # -- the protocol ---------------------------------------------------------------------
    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        dialect = self.dialect
        params = dialect.acquire_params(key, owner, holder, ttl)
        rows, _ = self._execute(list(zip(dialect.acquire_sql, params, strict=True)), hot=True)
        if not rows:
            return AcquireResult(None)
        fence, retry_in = rows[0][0], rows[0][1]
        if fence is not None:
            return AcquireResult(int(fence))
        return AcquireResult(None, None if retry_in is None else max(0.0, float(retry_in)))

    def release(self, key: str, owner: str) -> bool:
        _, count = self._execute(
            [(self.dialect.release_sql, (key, owner))], hot=True, idempotent=False
        )
        released = count > 0
        if released:
            self.wake_board.wake(key)
        return released

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        dialect = self.dialect
        _, count = self._execute(
            [(dialect.extend_sql, dialect.extend_params(key, owner, ttl))], hot=True
        )
        return count > 0

    def get(self, key: str) -> LockInfo | None:
        rows, _ = self._execute([(self.dialect.get_sql, (key,))])
        return self._info(rows[0]) if rows else None

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        last = ""
        while True:
            rows, _ = self._execute(
                [(self.dialect.page_sql, (last, len(prefix), prefix, PAGE_SIZE))]
            )
            for row in rows:
                yield self._info(row)
            if len(rows) < PAGE_SIZE:
                return
            last = rows[-1][0]

    def prune(self) -> int:
        """Delete expired rows, PRUNE_BATCH at a time; how many.

        An acquire draws the fence it would insert before it looks for the key's row. Were that
        row deleted in between, the insert would carry a fence lower than the deleted row's; so
        each batch first waits for the acquires in flight to commit (new ones wait for the
        batch), and raises LockStoreUnavailable if that takes more than a second.
        """
        dialect = self.dialect
        statements = [
            *((sql, ()) for sql in dialect.prune_guard),
            (dialect.prune_sql, (PRUNE_BATCH,)),
            *((sql, ()) for sql in dialect.prune_unguard),
        ]
        pruned = 0
        while True:
            _, count = self._execute(statements, result_of=len(dialect.prune_guard))
            pruned += max(count, 0)
            if count < PRUNE_BATCH:
                return pruned

    def _info(self, row: Row) -> LockInfo:
        key, owner, holder, fence, acquired_at, remaining = row[:6]
        return LockInfo(
            key=key,
            owner=owner,
            holder=holder,
            fence=int(fence),
            acquired_at=self.dialect.datetime(acquired_at),
            expires_in=max(0.0, float(remaining or 0.0)),
        )

    # -- wake-ups -------------------------------------------------------------------------
    @property
    def push_wakeups(self) -> bool:
        return self.listener_ready()

    def watch(self, key: str) -> Any:
        if self.push_possible and self.dialect.vendor == "postgresql":
            self.ensure_listener(lambda: _PostgresListener(self))
        return self.wake_board.watch(key)

    def close(self) -> None:
        self.stop_listener()
        self._threads.close_all()


def _is_psycopg3(wrapper: Any) -> bool:
    return bool(getattr(wrapper.Database, "__name__", "") == "psycopg")


class _ThreadConnection:
    """One thread's connection, the cursor it reuses (a cursor per call costs ~10%) and, on
    PostgreSQL with psycopg 3, its direct libpq path."""

    __slots__ = ("check", "cursor", "direct", "wrapper")

    def __init__(self, wrapper: Any, direct: _Direct | None = None) -> None:
        self.wrapper, self.cursor, self.direct = wrapper, wrapper.connection.cursor(), direct
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


_PLACEHOLDER = re.compile(r"%s")


class _Direct:
    """Statements prepared on one psycopg 3 connection and run by libpq itself.

    psycopg's cursor spends about 40 µs a statement in Python (adapting, describing, building
    rows); a lock statement needs none of it: its parameters are a few strings and numbers, and
    what comes back is a number or NULL. The blocking libpq call releases the GIL like
    psycopg's own wait does. Only the store's own thread uses this connection.
    """

    __slots__ = ("names", "pgconn")

    def __init__(self, pgconn: Any) -> None:
        self.pgconn = pgconn
        self.names: dict[str, bytes] = {}  # SQL text -> its prepared statement's name

    def _prepare(self, sql: str, error: type[Exception]) -> bytes:
        name = f"keel_lock_{hashlib.md5(sql.encode()).hexdigest()[:16]}".encode()
        number = itertools.count(1)  # the driver's %s placeholders become $1, $2, ...
        numbered = _PLACEHOLDER.sub(lambda _: f"${next(number)}", sql)
        result = self.pgconn.prepare(name, numbered.encode())
        if result.status not in _RESULT_OK:
            raise _failure(result, error)
        self.names[sql] = name
        return name

    def execute(
        self, statements: Sequence[tuple[str, Sequence[Any]]], error: type[Exception]
    ) -> tuple[list[Row], int]:
        result: Any = None
        for sql, params in statements:
            name = self.names.get(sql) or self._prepare(sql, error)
            values = [None if p is None else str(p).encode() for p in params]
            result = self.pgconn.exec_prepared(name, values)
            if result.status not in _RESULT_OK:
                raise _failure(result, error)
        if result is None:
            return [], 0
        fields = result.nfields
        if fields == 0:  # UPDATE and the like: no rows, a count
            return [], result.command_tuples or 0
        get, columns = result.get_value, range(fields)
        rows: list[Row] = [
            tuple([get(row, col) for col in columns]) for row in range(result.ntuples)
        ]
        return rows, len(rows)


def _failure(result: Any, error: type[Exception]) -> Exception:
    """The driver error for a libpq result that is not a success."""
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    return error(message or f"libpq status {result.status}")


# libpq's PGRES_COMMAND_OK and PGRES_TUPLES_OK (fixed by libpq's ABI).
_RESULT_OK = frozenset({1, 2})


def _close_connection(conn: _ThreadConnection) -> None:
    """Close the driver connection itself: Django's close() would refuse to run inside an
    event loop (override_settings in an async test, an ASGI shutdown) and leak it."""
    raw, conn.wrapper.connection = conn.wrapper.connection, None
    if raw is not None:
        raw.close()


def release_channel(key: str) -> str:
    """The channel a release of `key` is NOTIFYed on (md5 as PostgreSQL computes it)."""
    return CHANNEL_PREFIX + hashlib.md5(key.encode("utf-8")).hexdigest()


class _PostgresListener(ReleaseListener):
    """One LISTEN connection per process, listening to the channels of the keys this process
    waits for: turns other processes' releases into wake-ups."""

    store: DatabaseLockStore
    fileno: int | None = None

    def listen(self) -> None:
        base = connections[self.store.database]
        wrapper = type(base)(self.store._connection_settings(), self.store.database)
        params = {**LISTEN_TCP, **wrapper.get_connection_params()}
        raw = wrapper.get_new_connection(params)
        self.fileno = raw.fileno()  # for inspection: the connection is this thread's alone
        if not hasattr(raw, "notifies"):  # psycopg2: no push wake-ups, waiters poll
            raw.close()
            self.store.push_possible = False
            self.stopping.set()
            return
        board = self.store.wake_board
        keys_by_channel: dict[str, str] = {}

        def subscribe(keys: list[str]) -> None:
            for key in keys:
                channel = release_channel(key)
                keys_by_channel[channel] = key
                raw.execute(f"LISTEN {channel}")  # returns once the server listens

        def unsubscribe(keys: list[str]) -> None:
            for key in keys:
                channel = release_channel(key)
                keys_by_channel.pop(channel, None)
                raw.execute(f"UNLISTEN {channel}")

        subscribed: set[str] = set()
        try:
            raw.autocommit = True
            self.take_changes()
            self.settle(subscribed, set(board.watched_keys()), subscribe, unsubscribe)
            self.ready.set()
            board.wake_all()  # a release may have happened while we were (re)connecting
            quiet_since = time.monotonic()
            while not self.stopping.is_set():
                data, poked = self.wait(raw.fileno(), 1.0)
                if poked:
                    self.settle(subscribed, self.take_changes(), subscribe, unsubscribe)
                if data or poked:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > LISTEN_PING:
                    # A silently dead link must not keep `ready` set: ask, and raise if gone.
                    raw.execute("SELECT 1")
                    quiet_since = time.monotonic()
                # Also yields what arrived while LISTEN/UNLISTEN ran (psycopg keeps a backlog).
                for notify in raw.notifies(timeout=0):
                    key = keys_by_channel.get(notify.channel)
                    if key is not None:
                        board.wake(key)
        finally:
            self.ready.clear()
            raw.close()
