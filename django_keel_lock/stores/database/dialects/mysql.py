"""MariaDB: an upsert plus a read of the row per acquire; a release that finds a waiter hands
the lock over to the first in the key's line, or rings the key's doorbell (see MySQLDialect)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from .base import ServerDialect, line_statements, permit_listing, permit_transaction
from .schema import PERMIT_TABLE, RELEASED, SEQUENCE, TABLE, WAITER_TABLE

#: The doorbell of a key is BELL_SLOTS named locks, BELL_PREFIX + md5(key) + ":" + slot: each
#: listener waiting for the key holds one of them (see `bell_names`).
BELL_PREFIX = "keel_lock:"
BELL_SLOTS = 32
#: A listener also holds ADDRESS_PREFIX + its wake address (see `ReleaseListener.address`), so
#: that a release can reach the process of the first waiter in a key's line, and only it.
ADDRESS_PREFIX = "keel_lock:at:"
#: The database's clock (UTC, as the rows are written), and seconds until `{column}` by it.
_NOW = "UTC_TIMESTAMP(6)"
_REMAINING_TEMPLATE = "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {column}) / 1000000.0"
_REMAINING = _REMAINING_TEMPLATE.format(column="expires_at")


class MySQLDialect(ServerDialect):
    """MariaDB (10.3+: sequences). Acquire is an upsert plus a read of the row.

    Releases push wake-ups to other processes through doorbells, since MariaDB has no
    LISTEN/NOTIFY. A refused acquire raises the row's `waiting` flag (as on PostgreSQL). The
    release writes the flag through LAST_INSERT_ID(expr), whose value comes back in the
    statement's own OK packet (the driver's `lastrowid`): a release learns whether someone
    waited without another round trip, and one that nobody waited for costs nothing extra.
    One that finds the flag raised then rings the key's doorbell (`ring_sql`, `kill_sql`);
    where a live waiter stands in the key's line, the release hands the lock over to the
    first one instead, in one transaction, and interrupts only its listener's nap just before
    the transaction commits (the listener's read of the grant waits for that commit;
    `release_free_sql`, `hand_over_sql`, `grant_sql`; the listener
    then reads the grant: `grants_sql`).

    A doorbell is a set of named locks (GET_LOCK): the listener of each process that waits for
    the key holds one slot of it on a connection that naps, waiting in GET_LOCK for a name its
    other connection holds (see `MariaDBListener`). Ringing reads the slots' holders
    (IS_USED_LOCK: connection ids) and interrupts each one's nap with KILL QUERY, which needs
    no privilege for connections of the same user. A named lock lives exactly as long as its
    connection, so a listener that died leaves no registration behind, and subscribing writes
    to no table. Why not a named lock the holder keeps while it holds the key, for waiters to
    block on: a lock may be released by another connection than the one that took it (another
    thread, a restored token), which cannot release that connection's named lock.

    A KILL QUERY that reaches a connection between two statements does nothing, so a ring can
    be lost; the listener wakes its waiters each time it starts a new nap (see there). A ring
    costs the releaser 1 + (waiting processes) round trips, only when someone waited; a KILL
    refused (a listener of another database user) is skipped, and its waiters wake at their
    listener's next nap.
    """

    vendor = "mysql"
    remaining_template = _REMAINING_TEMPLATE
    _free = f"(expires_at <= {_NOW} OR owner = VALUES(owner))"
    # MySQL applies SET assignments left to right, so `owner` and `expires_at` (which the
    # condition reads) come last and `expires_at` sees the already-updated owner. A refusal
    # raises `waiting`; a take by another owner lowers it (as PostgreSQL's acquire does).
    acquire_sql = (
        f"""
        INSERT INTO {TABLE} (`key`, owner, holder, fence, acquired_at, expires_at)
        VALUES (%s, %s, %s, NEXTVAL({SEQUENCE}), {_NOW}, {_NOW} + INTERVAL %s MICROSECOND)
        ON DUPLICATE KEY UPDATE
            waiting = IF({_free}, IF(owner = VALUES(owner), waiting, NULL), TRUE),
            holder = IF({_free}, VALUES(holder), holder),
            fence = IF({_free}, NEXTVAL({SEQUENCE}), fence),
            acquired_at = IF({_free}, VALUES(acquired_at), acquired_at),
            owner = IF({_free}, VALUES(owner), owner),
            expires_at = IF(owner = VALUES(owner), VALUES(expires_at), expires_at)
        """,
        f"SELECT IF(owner = %s, fence, NULL), IF(owner = %s, NULL, {_REMAINING}), "
        f"IF(LEFT(owner, 1) = '*', owner, NULL) FROM {TABLE} WHERE `key` = %s",
    )
    # A waiter in the line (`LockStore.acquire_queued`): a free row is taken only while its
    # flag is down. `waiting` is assigned first, and the assignments after it read its new
    # value: it stays down where the row is taken, and is TRUE where it is refused, so every
    # later condition agrees with the first.
    _free_queued = f"(owner = VALUES(owner) OR (expires_at <= {_NOW} AND waiting IS NOT TRUE))"
    acquire_queued_sql = (
        acquire_sql[0].replace(_free, _free_queued),
        acquire_sql[1],
    )
    # UTC_TIMESTAMP() is read once, when a statement starts: an extend that started before a
    # release but gets the row after it would still find the released row unexpired. It finds
    # no owner of its own there (see Dialect.release_sql), so it cannot bring the lock back.
    # The flag is written back as it was, through LAST_INSERT_ID(): the reply carries it.
    _release = (
        f"UPDATE {TABLE} l SET waiting = {{waiting}}, owner = {RELEASED}, expires_at = {_NOW} "
        f"WHERE l.`key` = %s AND l.owner = %s AND l.expires_at > {_NOW}"
    )
    release_sql = _release.format(waiting="LAST_INSERT_ID(IFNULL(waiting, 0))")
    # Where the database has the line's table, a release (key, owner) frees the row in one
    # statement while its flag is down (nobody was refused it since its take); else it goes
    # on in `MariaDB.handing_over`'s transaction, which hands the lock over to the first live
    # waiter in line, or frees it and rings the doorbell where nobody stands in the line (a
    # caller outside it raised the flag). So does a release of a key whose last release here
    # handed it over, at once. Not a read of the line here: a subquery costs the statement
    # ~60 us even where it does not run, 6 % of an uncontended cycle.
    release_free_sql = release_sql + " AND l.waiting IS NOT TRUE"
    # (key, owner): where that statement did not free the lock, or for a key whose last
    # release here found its flag up and nobody in line (`MariaDB._release_unlined`): the
    # lock is freed unless a live waiter handed nothing yet stands in its line. Its row
    # matches while `owner` holds the lock (FOUND_ROWS); LAST_INSERT_ID() says 0 or 1: freed,
    # the flag as it was; 2: not freed, for the transaction that hands it over. `owner`
    # (whose condition reads the line, before it is assigned) comes first; `waiting` keeps
    # its value.
    _lined = (
        f"l.waiting IS TRUE AND EXISTS (SELECT 1 FROM {WAITER_TABLE} f WHERE f.`key` = l.`key` "
        f"AND f.owner <> l.owner AND f.expires_at > {_NOW} AND f.fence IS NULL)"
    )
    release_unlined_sql = (
        f"UPDATE {TABLE} l SET l.owner = IF({_lined}, l.owner, {RELEASED}), "
        f"l.expires_at = IF(l.owner = {RELEASED}, {_NOW}, l.expires_at), "
        f"l.waiting = IF(LAST_INSERT_ID(IF(l.owner = {RELEASED}, IFNULL(l.waiting, 0), 2)) < 0, "
        f"NULL, l.waiting) WHERE l.`key` = %s AND l.owner = %s AND l.expires_at > {_NOW}"
    )
    # The hand-over's first statement (`MariaDB.handing_over`), its row locked until COMMIT:
    # (owner, fence, fence, owner, key) -> (whether owner holds the lock, at that fence
    # unless it is NULL: a grant `leave_queue` passes on; whether its `waiting` flag is up;
    # then the first live waiter of its line handed nothing yet, but owner's own place,
    # locked, if the flag is up: its place's id, owner, holder, ttl, microseconds left, the
    # connection id holding its wake address's lock (0: none), its place's `listener`; and a
    # new fence). The lock row is read first (the driving table of the LEFT JOIN), as the
    # line's writers lock it before their places. The fence is drawn while the row is
    # locked, as every fence of the key (one drawn for a release that grants nothing is
    # skipped, never reused).
    hand_over_sql = (
        f"SELECT l.owner = %s AND l.expires_at > {_NOW} AND (%s IS NULL OR l.fence = %s), "
        "l.waiting IS TRUE, w.id, w.owner, w.holder, w.ttl, "
        f"TIMESTAMPDIFF(MICROSECOND, {_NOW}, w.expires_at), "
        f"IFNULL(IS_USED_LOCK(CONCAT('{ADDRESS_PREFIX}', NULLIF(w.address, ''))), 0), "
        f"w.listener, NEXTVAL({SEQUENCE}) "
        f"FROM {TABLE} l LEFT JOIN {WAITER_TABLE} w ON w.id = IF(l.waiting IS TRUE, "
        f"(SELECT f.id FROM {WAITER_TABLE} f WHERE f.`key` = l.`key` AND f.owner <> %s "
        f"AND f.expires_at > {_NOW} AND f.fence IS NULL ORDER BY f.id LIMIT 1), NULL) "
        "WHERE l.`key` = %s FOR UPDATE"
    )
    # (key): the row `hand_over_sql` locked is freed (nobody to hand it over to); its flag
    # stays as it was.
    free_sql = f"UPDATE {TABLE} SET owner = {RELEASED}, expires_at = {_NOW} WHERE `key` = %s"
    # (owner, holder, fence, microseconds, fence, key, place id): the lock is the waiter's, its
    # place marked with the fence (so that `leave_queue` can tell a grant not taken up, and
    # the listener of its process find it: `grants_sql`). The flag stays raised.
    grant_sql = (
        f"UPDATE {TABLE} l JOIN {WAITER_TABLE} w ON w.`key` = l.`key` "
        f"SET l.owner = %s, l.holder = %s, l.fence = %s, l.acquired_at = {_NOW}, "
        f"l.expires_at = {_NOW} + INTERVAL %s MICROSECOND, w.fence = %s "
        "WHERE l.`key` = %s AND w.id = %s"
    )
    # The listener's read, once a KILL ended its nap ({keys}: the keys it listens to): first a
    # shared lock of their lock rows, which waits until a release that KILLed it before its
    # COMMIT has ended (only the lock rows, in the index's order, as every writer of a line
    # locks its row first; released as the statement ends), then a consistent read (then its
    # wake address): the grants that releases carried to waiters of its process, live, and
    # made for the waiter's whole ttl (a grant made for less, while its listener was away,
    # is taken up by the waiter's next attempt).
    grants_wait_sql = f"SELECT COUNT(*) FROM {TABLE} WHERE `key` IN ({{keys}}) LOCK IN SHARE MODE"
    grants_lock_wait_sql = "SET SESSION innodb_lock_wait_timeout = 1"
    grants_sql = (
        f"SELECT w.`key`, w.owner, w.fence FROM {WAITER_TABLE} w JOIN {TABLE} l "
        "ON l.`key` = w.`key` AND l.owner = w.owner AND l.fence = w.fence "
        f"WHERE w.`key` IN ({{keys}}) AND w.address = %s AND w.fence IS NOT NULL "
        f"AND l.expires_at > {_NOW} "
        "AND TIMESTAMPDIFF(MICROSECOND, l.acquired_at, l.expires_at) >= w.ttl * 1000000 - 1"
    )
    # (key, owner) -> (the fence it was handed, NULL if none,): `owner` leaves key's line.
    leave_returning_sql = (
        f"DELETE FROM {WAITER_TABLE} WHERE `key` = %s AND owner = %s RETURNING fence"
    )
    # (the key's bell_names) -> the connection id holding each slot, NULL for a free one
    ring_sql = "SELECT " + ", ".join(["IS_USED_LOCK(%s)"] * BELL_SLOTS)
    # The listener of the first live waiter of a key's line ({key}): its connection id, 0
    # when it has none to reach (no address: it polls; or its listener is reconnecting). A
    # place marked with a grant counts only while its waiter owns the lock ({owner}): one
    # that took a carried grant keeps its place until that lapses.
    _first = (
        f"SELECT IFNULL(IS_USED_LOCK(CONCAT('{ADDRESS_PREFIX}', NULLIF(w.address, ''))), 0) "
        f"FROM {WAITER_TABLE} w WHERE w.`key` = {{key}} AND w.expires_at > {_NOW} "
        "AND (w.fence IS NULL OR w.owner = {owner}) ORDER BY w.id LIMIT 1"
    )
    _first_of_key = _first.format(
        key="%s", owner=f"(SELECT o.owner FROM {TABLE} o WHERE o.`key` = %s)"
    )
    # (key, key, the key's bell_names) -> that first waiter (NULL: the line is empty), then
    # the doorbell as `ring_sql` reads it: the same one round trip as a ring without lines.
    ring_line_sql = f"SELECT ({_first_of_key}), " + ", ".join(["IS_USED_LOCK(%s)"] * BELL_SLOTS)
    # The first in a key's line takes the lock in one statement (see
    # ServerDialect.take_first_sql): the lock a release handed it (its owner already: the
    # grant taken up, its fence and acquired_at kept, live `ttl` from now on), or the free
    # lock. A multi-table UPDATE of the lock row and the waiter's own place, which lapses (the
    # next waiter to join the line deletes it). Both rows are found by a unique key, so they
    # are locked before the subqueries read the line. The fence comes back through
    # LAST_INSERT_ID(), as the release's flag does. `owner` and `expires_at`, which
    # `_GRANTED` reads, are assigned last (MariaDB assigns left to right).
    _GRANTED = f"(l.owner = %(owner)s AND l.expires_at > {_NOW})"
    take_first_sql = f"""
        UPDATE {TABLE} l JOIN {WAITER_TABLE} w ON w.`key` = l.`key` AND w.owner = %(owner)s
        SET l.waiting = EXISTS (SELECT 1 FROM {WAITER_TABLE} o WHERE o.`key` = l.`key`
                                AND o.owner <> %(owner)s AND o.expires_at > {_NOW}) OR NULL,
            l.holder = %(holder)s,
            l.fence = LAST_INSERT_ID(IF({_GRANTED}, l.fence, NEXTVAL({SEQUENCE}))),
            l.acquired_at = IF({_GRANTED}, l.acquired_at, {_NOW}), l.owner = %(owner)s,
            l.expires_at = {_NOW} + INTERVAL %(ttl)s MICROSECOND, w.expires_at = {_NOW}
        WHERE l.`key` = %(key)s AND w.expires_at > {_NOW} AND ({_GRANTED}
          OR (l.expires_at <= {_NOW}
              AND NOT EXISTS (SELECT 1 FROM {WAITER_TABLE} e WHERE e.`key` = l.`key`
                              AND e.expires_at > {_NOW} AND e.id < w.id
                              AND (e.fence IS NULL OR e.owner = l.owner))))
    """
    # (key, key) -> (that first waiter,) if the lock is free (`leave_queue`).
    wake_first_sql = (
        f"SELECT ({_first.format(key='%s', owner='l.owner')}) FROM {TABLE} l "
        f"WHERE l.`key` = %s AND l.expires_at <= {_NOW}"
    )
    kill_sql = "KILL QUERY %s"  # (connection id)
    # A transaction of the store idle this many seconds (SOCKET_TIMEOUT) is ended by the
    # server, its row locks freed (`MariaDB.session_statements`).
    idle_transaction_sql = "SET SESSION idle_transaction_timeout = {seconds:d}"
    # The listener's statements. (bell_names) -> the slot taken, NULL if all are taken: CASE
    # tries the slots in order and stops at the first it gets.
    subscribe_sql = (
        "SELECT CASE "
        + " ".join(f"WHEN GET_LOCK(%s, 0) THEN {slot}" for slot in range(BELL_SLOTS))
        + " END"
    )
    unsubscribe_sql = "SELECT RELEASE_LOCK(%s)"  # (the slot's name)
    # A nap waits for the anchor, a name the listener's other connection holds: 0 when it ran
    # out, NULL when KILLed, 1 if the anchor was free (its holder gone). Not SELECT SLEEP:
    # MariaDB wakes every SLEEP through one mutex, so KILLs of naps running at once can each
    # wait up to two seconds for it; a GET_LOCK wait has a mutex of its own.
    anchor_sql = "SELECT GET_LOCK(%s, 0)"  # (anchor_name, or the wake address's lock name)
    nap_sql = "SELECT GET_LOCK('{anchor}', {seconds:g})"
    #: Errors of a KILL that are not the store's fault: the listener went away meanwhile
    #: (1094), or runs as another user and we may not interrupt it (1095).
    kill_refusals = frozenset({1094, 1095})
    extend_sql = f"""
        UPDATE {TABLE}
        SET expires_at = GREATEST(expires_at, {_NOW} + INTERVAL %s MICROSECOND)
        WHERE `key` = %s AND owner = %s AND expires_at > {_NOW}
    """
    get_sql = (
        f"SELECT `key`, owner, holder, fence, acquired_at, {_REMAINING} FROM {TABLE} "
        f"WHERE `key` = %s AND expires_at > {_NOW}"
    )
    page_sql = (
        f"SELECT `key`, owner, holder, fence, acquired_at, {_REMAINING} FROM {TABLE} "
        f"WHERE `key` > %s AND LEFT(`key`, %s) = %s AND expires_at > {_NOW} "
        "ORDER BY `key` LIMIT %s"
    )
    prune_sql = f"DELETE FROM {TABLE} WHERE expires_at <= {_NOW} LIMIT %s"
    # READ COMMITTED for the sweep's deletes (SET TRANSACTION: the next transaction, here
    # that one statement): under REPEATABLE READ a delete by a key that is gone locks the gap
    # there, and inserts of new keys into it would wait. An acquire runs as one statement,
    # which PROCESSLIST shows as executing (with its QUERY_ID) from before it draws its fence
    # until it has committed. A user without the PROCESS privilege sees only its own
    # connections: every process locking through this table must connect as the same user,
    # or have PROCESS.
    read_committed = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
    sweep_before = (read_committed,)
    sweep_select = f"SELECT `key` FROM {TABLE} WHERE fence <= %s AND expires_at <= {_NOW} LIMIT %s"
    sweep_delete = (
        f"DELETE FROM {TABLE} WHERE fence <= %s AND `key` {{names}} AND expires_at <= {_NOW}"
    )
    _orphan = (
        f"expires_at <= {_NOW} AND NOT EXISTS "
        f"(SELECT 1 FROM {TABLE} l WHERE l.`key` = {PERMIT_TABLE}.`key`)"
    )
    sweep_permits_select = f"SELECT id FROM {PERMIT_TABLE} WHERE {_orphan} LIMIT %s"
    sweep_permits_delete = f"DELETE FROM {PERMIT_TABLE} WHERE id {{names}} AND {_orphan}"
    sweep_mark_sql = f"SELECT NEXTVAL({SEQUENCE})"
    # Not the listeners' naps (a GET_LOCK wait of up to a nap, which never writes the table):
    # they would hold every round off until they end.
    sweep_busy_sql = (
        "SELECT CONCAT(ID, ':', QUERY_ID) FROM information_schema.PROCESSLIST "
        "WHERE ID <> CONNECTION_ID() AND COMMAND IN ('Query', 'Execute') AND DB = DATABASE() "
        "AND COALESCE(INFO, '') NOT LIKE 'SELECT GET_LOCK(%%'"
    )
    # A WRITE table lock waits for the metadata lock every acquire holds from before it draws
    # its fence until it commits (LOCK TABLES needs that privilege; ALL PRIVILEGES has it).
    prune_guard = (
        "SET @keel_lock_wait = @@SESSION.lock_wait_timeout, SESSION lock_wait_timeout = 1",
        f"LOCK TABLES {TABLE} WRITE",
    )
    prune_unguard = ("UNLOCK TABLES", "SET SESSION lock_wait_timeout = @keel_lock_wait")

    # Permits: one transaction, decided in Python (`database.permits`). The no-op update of an
    # existing key locks its row as a plain INSERT would not (INSERT IGNORE would also turn a
    # key the column cannot hold into a warning and a truncated key, not an error).
    permit_listing = permit_listing(
        p="%s",
        key="`key`",
        now=_NOW,
        remaining=remaining_template,
        prune=f"DELETE FROM {PERMIT_TABLE} WHERE expires_at <= {_NOW} LIMIT %s",
    )
    transaction = permit_transaction(
        p="%s",
        key="`key`",
        now=_NOW,
        until=f"{_NOW} + INTERVAL %s MICROSECOND",
        greatest="GREATEST",
        next_fence=f"NEXTVAL({SEQUENCE})",
        remaining=remaining_template,
        keep_existing="ON DUPLICATE KEY UPDATE `key` = `key`",
        for_update=" FOR UPDATE",
        raise_waiting=True,
    )

    # A refusal in the line reports the fence of the key's row, read while it is locked
    # (`AcquireResult.last_fence`): every later fence of the key is drawn while the row is
    # locked again (a grant: `hand_over_sql`), so it is greater.
    line_last_fence_from_row = True
    # The table as migration 0009 leaves it (its last column): see PostgresDialect's.
    line_table_sql = (
        "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
        f"AND TABLE_NAME = '{WAITER_TABLE}' AND COLUMN_NAME = 'listener'"
    )
    line = line_statements(
        p="%s",
        key="`key`",
        now=_NOW,
        until=f"{_NOW} + INTERVAL %s MICROSECOND",
        remaining=remaining_template,
        next_fence=f"NEXTVAL({SEQUENCE})",
        keep_existing="ON DUPLICATE KEY UPDATE `key` = `key`",
        prune=f"DELETE FROM {WAITER_TABLE} WHERE expires_at <= {_NOW} LIMIT %s",
    )

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, round(ttl * 1_000_000)), (owner, owner, key)]

    @staticmethod
    def address_lock(address: str) -> str:
        """The named lock the listener whose wake address is `address` holds."""
        return ADDRESS_PREFIX + address

    def interval(self, seconds: float) -> Any:
        return round(seconds * 1_000_000)  # microseconds

    def bell_names(self, key: str) -> list[str]:
        # md5 of the key's UTF-8 bytes, computed here for both sides: a name is at most 64
        # characters, whatever the key.
        digest = hashlib.md5(key.encode("utf-8")).hexdigest()
        return [f"{BELL_PREFIX}{digest}:{slot}" for slot in range(BELL_SLOTS)]

    @staticmethod
    def anchor_name(connection_id: int) -> str:
        """The anchor of the listener whose other connection is `connection_id`."""
        return f"{BELL_PREFIX}nap:{connection_id}"

    @staticmethod
    def released_waiting(cursor: Any) -> bool:
        """Whether the release (`release_sql` and its kin) that just ran on `cursor` found
        the `waiting` flag raised: it came back through LAST_INSERT_ID()."""
        return int(cursor.lastrowid or 0) > 0

    def taken_fence(self, cursor: Any) -> int | None:
        return int(cursor.lastrowid) if cursor.rowcount > 0 else None

    def connection_options(
        self, options: dict[str, Any], wrapper: Any, socket_timeout: float
    ) -> None:
        from MySQLdb.constants.CLIENT import FOUND_ROWS

        self.limit_connect_timeout(options, socket_timeout)
        # Keys may hold any Unicode character: talk utf8mb4 whatever the project's charset.
        options["charset"] = "utf8mb4"
        # Rows matched, not rows changed: an extend that leaves expires_at as it was still
        # counts (Django asks for this flag, but a client_flag in OPTIONS replaces it).
        options["client_flag"] = int(options.get("client_flag", 0)) | FOUND_ROWS
