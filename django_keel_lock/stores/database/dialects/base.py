"""What a database dialect provides; one module per vendor fills it in."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

from .schema import PERMIT_TABLE, RELEASED, TABLE, WAITER_TABLE

T = TypeVar("T")


class Dialect:
    """The SQL every database the store supports speaks. Placeholders are the driver's own
    (%s, or ? for SQLite). What only some speak is in a subclass: `ServerDialect` (PostgreSQL,
    MariaDB: fences from a sequence, lines of waiters), and each vendor's own module."""

    vendor: str
    acquire_sql: Sequence[str]  # run in order; the last one's first row is (fence, retry_in)
    release_sql: str  # expires the row and sets its owner to RELEASED
    extend_sql: str
    get_sql: str
    page_sql: str
    prune_sql: str  # deletes at most %s expired rows
    # Run before and after each prune batch: they hold off every acquire in flight (see
    # DatabaseLockStore.prune), and give up after a second rather than stall acquires longer.
    prune_guard: Sequence[str] = ()
    prune_unguard: Sequence[str] = ()
    # Clean-up as part of normal work (DatabaseLockStore._sweep). A round reads the free rows
    # it may delete (`sweep_select`, no locks taken), then deletes those still free
    # (`sweep_delete`, by key): the scan never holds a row lock, so no acquire waits for it.
    sweep_select: str  # (*sweep_params, limit) -> rows of (key,)
    sweep_delete: str  # {names}: the keys (see `sweep_names`); (*sweep_params, *those)
    #: The same for expired permits of keys that have no lock row any more (a busy key keeps
    #: its slots, rewritten in place): (limit) -> rows of (id,); {names}: the ids.
    sweep_permits_select: str
    sweep_permits_delete: str
    sweep_before: Sequence[str] = ()  # run before each delete, in the same round trip's turn

    #: Reading permits; deciding them is each vendor's (see `database.vendors`).
    permit_listing: PermitListing
    begin_sql = "BEGIN"

    #: Seconds until `{column}` (a timestamp) passes, by the database's clock; the admin's
    #: changelist uses it too, so the two never disagree about whether a lock is held.
    remaining_template: str

    def remaining(self, column: str) -> str:
        return self.remaining_template.format(column=column)

    def connection_options(
        self, options: dict[str, Any], wrapper: Any, socket_timeout: float
    ) -> None:
        """Adjust the OPTIONS of the store's own connections to `wrapper`'s database; the
        store's SOCKET_TIMEOUT also bounds connecting."""

    @staticmethod
    def limit_connect_timeout(options: dict[str, Any], seconds: float) -> None:
        """`connect_timeout` (whole seconds, as PostgreSQL's and MariaDB's drivers take it) to
        `seconds` rounded up, or the project's own if that is shorter."""
        limit = max(1, math.ceil(seconds))
        theirs = options.get("connect_timeout")
        try:
            if theirs is not None and 0 < int(theirs) < limit:
                limit = int(theirs)
        except (TypeError, ValueError):
            pass  # not a number: the driver will say so
        options["connect_timeout"] = limit

    def session_sql(self, durable: bool) -> Sequence[str]:
        """Statements run once on each new connection of the store."""
        return ()

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        raise NotImplementedError

    def sweep_names(self, delete: str, names: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        """`delete` with its {names} matching any of `names`, and the parameters for them."""
        marks = ", ".join([self.permit_listing.placeholder] * len(names))
        return delete.format(names=f"IN ({marks})"), names

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (self.interval(ttl), key, owner)

    def interval(self, seconds: float) -> Any:
        """`seconds` as the dialect's interval placeholder (`until` below) takes it."""
        return seconds

    def datetime(self, value: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if isinstance(value, datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value  # type: ignore[no-any-return]


class ServerDialect(Dialect):
    """A database server's dialect (PostgreSQL, MariaDB): an acquire draws its fence from a
    sequence, and exclusive waiters stand in a line (`models.Waiter`, `database.line`)."""

    # Where an acquire draws its fence before it looks for its key's row (a sequence in the
    # INSERT's VALUES), the sweep deletes only rows whose fence is at most a mark, once every
    # transaction that was writing the table when the mark was drawn has ended:
    sweep_mark_sql: str  # () -> (a fence drawn now,)
    sweep_busy_sql: str  # () -> rows of (an id of a transaction that writes the table now,)

    # -- the line of waiters (exclusive locks; see `LockStore.acquire_queued`) -------------
    line: LineStatements
    #: () -> (whether the database has the line's table as migration 0009 leaves it: where
    #: it has not, the store keeps no line, and releases do not look for one),
    line_table_sql: str
    #: `release_sql` where the database has the line's table: it also reaches the first
    #: waiter of the key's line (PostgreSQL: hands the lock over to it and NOTIFYs it, the
    #: release function of migration 0009; MariaDB hands it over in a transaction of its
    #: own instead, see `MySQLDialect.hand_over_sql`).
    release_line_sql: str
    #: (key, owner) -> (the fence it was handed, NULL if none,): `owner` leaves key's line.
    leave_returning_sql: str
    #: `acquire_sql` for a waiter that waits its turn: a free row is taken only while its
    #: `waiting` flag is down (nobody was refused since the last take), or by its own owner.
    acquire_queued_sql: Sequence[str]
    #: () -> (the last fence drawn,): what a refusal of a waiter in line reports
    #: (`AcquireResult.last_fence`) where a release carries grants in its wake-ups; None
    #: where none does.
    line_last_fence_sql: str | None = None
    #: True: that refusal reports the fence of the key's lock row instead, read while the
    #: row is locked (MariaDB, whose sequence has no last value shared by its sessions).
    line_last_fence_from_row = False
    #: (owner, holder, ttl, key: named) -> a waiter already in the line takes the free lock
    #: in one statement if it is first in it, its fence read by `taken_fence` (None: it goes
    #: on to the line's transaction).
    take_first_sql: str
    #: (key, key) -> wakes the first live waiter of key's line if the lock is free: PostgreSQL
    #: NOTIFYs it itself (a row when it did); MariaDB returns (its listener's connection id, 0
    #: when it has none to reach), for the store to interrupt.
    wake_first_sql: str

    def taken_fence(self, cursor: Any) -> int | None:
        """The fence of the `take_first_sql` that just ran on `cursor`, None if it took
        nothing: its one row."""
        row = cursor.fetchone()
        return None if row is None else int(row[0])


class InTransaction:
    """Statements of `dialect` run on `cursor`, inside the transaction the store opened: the
    base of the line's attempt (`database.line`) and of the permit operations
    (`database.permits`)."""

    def __init__(self, dialect: Dialect, cursor: Any) -> None:
        self.interval = dialect.interval
        self.cursor = cursor

    def run(self, sql: str, *params: Any) -> list[Any]:
        """The rows of `sql` run with `params` (none for a statement that returns none)."""
        self.cursor.execute(sql, params)
        return list(self.cursor.fetchall()) if self.cursor.description else []


def in_transaction(cursor: Any, begin: str, body: Callable[[Any], T]) -> T:
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


# Columns every reading query returns, in this order.
INFO = "key, owner, holder, fence, acquired_at, {remaining}"


#: The permit holding a key, with the same columns as INFO and then the lock's owner (its
#: PERMIT_OWNERS marker tells the permit's kind).
PERMIT_INFO = "p.key, p.owner, p.holder, p.fence, p.acquired_at, {remaining}, l.owner"


class PermitListing(NamedTuple):
    """The statements that read permits, one dialect's spelling."""

    holders: str  # (key, key) -> the live holders of key: INFO + owner of the lock, soonest first
    permits_of: str  # {keys}: placeholders, one per key -> PERMIT_INFO rows, by key, soonest first
    prune: str  # (limit) -> deletes at most limit expired permits
    placeholder: str

    def permits_of_keys(self, count: int) -> str:
        return self.permits_of.format(keys=", ".join([self.placeholder] * count))


def permit_listing(*, p: str, key: str, now: str, remaining: str, prune: str) -> PermitListing:
    """The PermitListing of a dialect whose placeholder is `p`, key column `key` (quoted as it
    must be), clock `now` and seconds-left template `remaining` ({column})."""
    lock_left = remaining.format(column="l.expires_at")
    permit_left = remaining.format(column="p.expires_at")
    markers = "('*shared', '*semaphore')"
    gate_live = f"l.owner IN {markers} AND l.expires_at > {now} AND p.expires_at > {now}"
    holders = (
        f"SELECT {PERMIT_INFO.format(remaining=permit_left)} "
        f"FROM {TABLE} l JOIN {PERMIT_TABLE} p ON p.{key} = l.{key} "
        f"WHERE l.{key} = {p} AND {gate_live} "
        "UNION ALL "
        f"SELECT l.{key}, l.owner, l.holder, l.fence, l.acquired_at, {lock_left}, l.owner "
        f"FROM {TABLE} l WHERE l.{key} = {p} AND l.owner NOT IN {markers} "
        f"AND l.expires_at > {now} "
        "ORDER BY 6, 4"
    )
    permits_of = (
        f"SELECT {PERMIT_INFO.format(remaining=permit_left)} "
        f"FROM {TABLE} l JOIN {PERMIT_TABLE} p ON p.{key} = l.{key} "
        f"WHERE l.{key} IN ({{keys}}) AND {gate_live} ORDER BY p.{key}, 6, p.fence"
    )
    return PermitListing(holders, permits_of, prune, p)


class PermitTransaction(NamedTuple):
    """The statements of a permit operation decided in Python, inside one transaction that
    first locks the key's lock row (`ensure_row`, `read`). Parameters as named. A permit is
    a slot of its key, rewritten in place (see `models.Permit`)."""

    ensure_row: str  # (key): a free row for key unless it has one; the row stays locked
    # (key) -> rows of (lock owner, seconds left, writer owner, writer's seconds left, lock
    # fence, slot, permit owner, permit's seconds left, permit fence, permit expires_at, lock
    # waiting), one per permit slot of the key (the slot's columns NULL when it has none)
    read: str
    next_fence: str  # () -> (fence,)
    insert_permit: str  # (key, slot, owner, holder, fence, interval): a new slot
    fill_slot: str  # (owner, holder, fence, interval, key, slot): a slot that is not live
    release_slot: str  # (key, slot): expired now, its owner RELEASED
    renew_permit: str  # (interval, key, slot): expires after interval
    extend_permit: str  # (interval, key, slot): expires after interval, if that is later
    open_gate: str  # (marker, fence, interval, key): the first permit's
    widen_gate: str  # (fence, interval, key): fence and expiry at least these
    gate_until: str  # (expires_at, key)
    free: str  # (key): as release_sql leaves a row
    take: str  # (owner, holder, fence, interval, key): an exclusive acquire's
    renew: str  # (interval, key): the owner's exclusive lock expires after interval
    set_writer: str  # (owner, interval, key)
    clear_writer: str  # (key)
    raise_waiting: str  # (key): someone was refused; "" where nobody listens for releases


def permit_transaction(
    *,
    p: str,
    key: str,
    now: str,
    until: str,
    greatest: str,
    next_fence: str,
    remaining: str,
    keep_existing: str,
    for_update: str,
    raise_waiting: bool = False,
) -> PermitTransaction:
    """The PermitTransaction of a dialect: placeholder `p`, key column `key`, clock `now`,
    `until` (the timestamp `p` interval from now), `greatest` (the SQL function), the SELECT
    expression of a new fence, seconds-left template `remaining` ({column}), the clause that
    makes an INSERT of an existing key do nothing, and the suffix that locks what a SELECT
    reads; `raise_waiting` where releases push wake-ups (the `waiting` flag is kept as
    PostgreSQL's functions keep it: raised by a refusal, lowered by a take, a gate's opening
    and a permit's release)."""
    where = f"WHERE {key} = {p}"
    left = remaining.format
    return PermitTransaction(
        ensure_row=_ensure_row(p=p, key=key, now=now, keep_existing=keep_existing),
        read=(
            f"SELECT l.owner, {left(column='l.expires_at')}, l.writer_owner, "
            f"{left(column='l.writer_until')}, l.fence, "
            f"p.slot, p.owner, {left(column='p.expires_at')}, p.fence, p.expires_at, l.waiting "
            f"FROM {TABLE} l LEFT JOIN {PERMIT_TABLE} p ON p.{key} = l.{key} "
            f"WHERE l.{key} = {p}{for_update}"
        ),
        next_fence=f"SELECT {next_fence}",
        **_slot_statements(p=p, key=key, now=now, until=until, greatest=greatest),
        open_gate=(
            f"UPDATE {TABLE} SET owner = {p}, holder = '', fence = {p}, acquired_at = {now}, "
            f"expires_at = {until}, waiting = FALSE {where}"
        ),
        widen_gate=(
            f"UPDATE {TABLE} SET fence = {greatest}(fence, {p}), "
            f"expires_at = {greatest}(expires_at, {until}) {where}"
        ),
        gate_until=f"UPDATE {TABLE} SET expires_at = {p}, waiting = FALSE {where}",
        free=f"UPDATE {TABLE} SET owner = {RELEASED}, expires_at = {now}, waiting = FALSE {where}",
        take=(
            f"UPDATE {TABLE} SET owner = {p}, holder = {p}, fence = {p}, acquired_at = {now}, "
            f"expires_at = {until}, waiting = FALSE {where}"
        ),
        renew=f"UPDATE {TABLE} SET expires_at = {until} {where}",
        set_writer=f"UPDATE {TABLE} SET writer_owner = {p}, writer_until = {until} {where}",
        clear_writer=f"UPDATE {TABLE} SET writer_owner = NULL, writer_until = NULL {where}",
        raise_waiting=f"UPDATE {TABLE} SET waiting = TRUE {where}" if raise_waiting else "",
    )


def _slot_statements(*, p: str, key: str, now: str, until: str, greatest: str) -> dict[str, str]:
    """The PermitTransaction statements that write a key's permit slots (`models.Permit`),
    as `permit_transaction` spells them."""
    slot = f"WHERE {key} = {p} AND slot = {p}"
    return {
        "insert_permit": (
            f"INSERT INTO {PERMIT_TABLE} ({key}, slot, owner, holder, fence, acquired_at, "
            f"expires_at) VALUES ({p}, {p}, {p}, {p}, {p}, {now}, {until})"
        ),
        "fill_slot": (
            f"UPDATE {PERMIT_TABLE} SET owner = {p}, holder = {p}, fence = {p}, "
            f"acquired_at = {now}, expires_at = {until} {slot}"
        ),
        "release_slot": (
            f"UPDATE {PERMIT_TABLE} SET owner = {RELEASED}, expires_at = {now} {slot}"
        ),
        "renew_permit": f"UPDATE {PERMIT_TABLE} SET expires_at = {until} {slot}",
        "extend_permit": (
            f"UPDATE {PERMIT_TABLE} SET expires_at = {greatest}(expires_at, {until}) {slot}"
        ),
    }


def _ensure_row(*, p: str, key: str, now: str, keep_existing: str) -> str:
    """(key): a free lock row for key unless it has one (`keep_existing`: the clause that
    makes the INSERT of an existing key do nothing)."""
    return (
        f"INSERT INTO {TABLE} ({key}, owner, holder, fence, acquired_at, expires_at) "
        f"VALUES ({p}, {RELEASED}, '', 0, {now}, {now}) {keep_existing}"
    )


class LineStatements(NamedTuple):
    """The statements of the line of waiters (`models.Waiter`), one dialect's spelling.
    Every write of a key's line but `leave` and the clean-up's runs while the key's lock row
    is locked (`lock`), so one key's waiters join and take one at a time, in order."""

    lock: str  # (key) -> (owner, seconds left, waiting, fence) of key's lock row, locked
    ensure_row: str  # (key): a free lock row for key unless it has one
    # (key) -> rows of (owner, seconds left, the fence it was handed or NULL), in the order
    # of arrival
    line: str
    next_fence: str  # () -> (fence,)
    take: str  # (owner, holder, fence, interval, waiting, key): the lock is owner's
    raise_waiting: str  # (key)
    # (key, owner, address, interval, holder, ttl, listener): a new place at the end
    join: str
    # (address, interval, holder, ttl, listener, key, owner): the place lasts interval more
    # (and is handed nothing: it was refused)
    stay: str
    leave: str  # (key, owner)
    drop_lapsed: str  # (key, owner): deletes the lapsed places of key but owner's
    sweep_select: str  # (limit) -> rows of (id,) of expired places
    sweep_delete: str  # {names}: the ids; deletes those still expired
    prune: str  # (limit): deletes at most limit expired places


def line_statements(
    *, p: str, key: str, now: str, until: str, remaining: str, next_fence: str,
    keep_existing: str, prune: str,
) -> LineStatements:  # fmt: skip
    """The LineStatements of a dialect: placeholder `p`, key column `key` (quoted as it must
    be), clock `now`, `until` (the timestamp `p` interval from now), seconds-left template
    `remaining` ({column}), the SELECT expression of a new fence, the clause that makes an
    INSERT of an existing key do nothing, and `prune` (limit)."""
    where = f"WHERE {key} = {p}"
    place = f"{where} AND owner = {p}"
    return LineStatements(
        lock=(
            f"SELECT owner, {remaining.format(column='expires_at')}, waiting, fence "
            f"FROM {TABLE} {where} FOR UPDATE"
        ),
        ensure_row=_ensure_row(p=p, key=key, now=now, keep_existing=keep_existing),
        line=(
            f"SELECT owner, {remaining.format(column='expires_at')}, fence FROM {WAITER_TABLE} "
            f"{where} ORDER BY id"
        ),
        next_fence=f"SELECT {next_fence}",
        take=(
            f"UPDATE {TABLE} SET owner = {p}, holder = {p}, fence = {p}, acquired_at = {now}, "
            f"expires_at = {until}, waiting = {p} {where}"
        ),
        raise_waiting=f"UPDATE {TABLE} SET waiting = TRUE {where}",
        join=(
            f"INSERT INTO {WAITER_TABLE} ({key}, owner, address, expires_at, holder, ttl, "
            f"listener) VALUES ({p}, {p}, {p}, {until}, {p}, {p}, {p})"
        ),
        stay=(
            f"UPDATE {WAITER_TABLE} SET address = {p}, expires_at = {until}, holder = {p}, "
            f"ttl = {p}, listener = {p}, fence = NULL {place}"
        ),
        leave=f"DELETE FROM {WAITER_TABLE} {place}",
        drop_lapsed=f"DELETE FROM {WAITER_TABLE} {where} AND owner <> {p} AND expires_at <= {now}",
        sweep_select=f"SELECT id FROM {WAITER_TABLE} WHERE expires_at <= {now} LIMIT {p}",
        sweep_delete=f"DELETE FROM {WAITER_TABLE} WHERE id {{names}} AND expires_at <= {now}",
        prune=prune,
    )
