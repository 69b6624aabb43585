"""The hot statements on PostgreSQL with psycopg 3, run by libpq itself: prepared once per
connection, or (behind a transaction pooler, where a connection's prepared statements may be on
another server connection) sent whole each time as unnamed statements."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Sequence
from typing import Any

Row = Sequence[Any]
Statement = tuple[str, Sequence[Any]]


_PLACEHOLDER = re.compile(r"%s")


class PreparedStatements:
    """Statements prepared on one psycopg 3 connection and run by libpq itself.

    psycopg's cursor adapts parameters, describes results and builds rows in Python; a lock
    statement needs none of it: its parameters are a few strings and numbers, and
    what comes back is a number or NULL. The blocking libpq call releases the GIL like
    psycopg's own wait does. Only the store's own thread uses this connection.

    Not `named`: each statement goes as an unnamed one (Parse, Bind, Execute and Sync in one
    round trip), which leaves nothing behind on the server connection: what a transaction
    pooler needs. The server then plans it each time.
    """

    __slots__ = ("__weakref__", "named", "names", "pgconn", "texts")

    def __init__(self, pgconn: Any, named: bool = True) -> None:
        self.pgconn, self.named = pgconn, named
        self.names: dict[str, bytes] = {}  # SQL text -> its prepared statement's name
        self.texts: dict[str, bytes] = {}  # SQL text -> as libpq takes it ($1, $2, ...)

    def _text(self, sql: str) -> bytes:
        number = itertools.count(1)  # the driver's %s placeholders become $1, $2, ...
        text = self.texts[sql] = _PLACEHOLDER.sub(lambda _: f"${next(number)}", sql).encode()
        return text

    def _prepare(self, sql: str, error: type[Exception]) -> bytes:
        name = f"keel_lock_{hashlib.md5(sql.encode()).hexdigest()[:16]}".encode()
        result = self.pgconn.prepare(name, self._text(sql))
        if result.status not in _RESULT_OK:
            raise _failure(result, error)
        self.names[sql] = name
        return name

    def execute(
        self, statements: Sequence[Statement], error: type[Exception], answered: bool = False
    ) -> tuple[list[Row], int]:
        """(rows, rowcount) of the last of `statements` run (see `one`); `answered`: the
        first that returns a row is the last run (the others are its fallbacks)."""
        rows: list[Row] = []
        count = 0
        for sql, params in statements:
            rows, count = self.one(sql, params, error)
            if answered and rows:
                break
        return rows, count

    def one(self, sql: str, params: Sequence[Any], error: type[Exception]) -> tuple[list[Row], int]:
        """Run `sql` with `params`: (its rows, as bytes or None, and how many), or for a
        statement that returns none (UPDATE and the like) ([], how many rows it changed). A
        failure is `error` (or psycopg's own class: see `_failure`). Every lock statement runs
        through here: no helper of ours is called on the way to a reply."""
        values = [None if p is None else str(p).encode() for p in params]
        if self.named:
            name = self.names.get(sql) or self._prepare(sql, error)
            result = self.pgconn.exec_prepared(name, values)
        else:
            result = self.pgconn.exec_params(self.texts.get(sql) or self._text(sql), values)
        if result.status not in _RESULT_OK:
            raise _failure(result, error)
        fields = result.nfields
        if not fields:
            return [], result.command_tuples or 0
        get, count = result.get_value, result.ntuples
        # Comprehensions, not tuple(map(...)): that asks the map for a length hint, which
        # costs an AttributeError raised and cleared each time.
        columns = _COLUMNS[fields] if fields < len(_COLUMNS) else range(fields)
        if count == 1:  # a lock statement's one row
            return [tuple([get(0, column) for column in columns])], 1
        rows: list[Row] = [tuple([get(row, column) for column in columns]) for row in range(count)]
        return rows, count


def _failure(result: Any, error: type[Exception]) -> Exception:
    """The driver error for a libpq result that is not a success: `error`, or for a data
    exception (SQLSTATE class 22: a value sent, such as a key the database's encoding cannot
    hold) or a missing table or function psycopg's own class for it, as its cursor would
    raise."""
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    sqlstate = result.error_field(_SQLSTATE) or b""
    # 42P01, 42883: a table or function of ours is missing (not migrated), which the store
    # tells from the class's sqlstate, as from its cursor's errors; 26000, 42P05: a prepared
    # statement missing or there already (a transaction pooler in front, see
    # `vendors.Postgres.lost_session`).
    if sqlstate.startswith(b"22") or sqlstate in _OWN_CLASS:
        from psycopg import errors

        try:
            error = errors.lookup(sqlstate.decode("ascii"))
        except KeyError:  # a code newer than this psycopg
            error = errors.DataError
    return error(message or f"libpq status {result.status}")


_OWN_CLASS = frozenset({b"42P01", b"42883", b"26000", b"42P05"})

#: The column numbers of a row of n columns, for the few n a lock statement returns.
_COLUMNS = tuple(tuple(range(n)) for n in range(8))

# libpq's PG_DIAG_SQLSTATE (fixed by libpq's ABI).
_SQLSTATE = 67


# libpq's PGRES_COMMAND_OK and PGRES_TUPLES_OK (fixed by libpq's ABI).
_RESULT_OK = frozenset({1, 2})
