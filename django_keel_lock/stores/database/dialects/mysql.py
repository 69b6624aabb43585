"""MariaDB: an upsert plus a read of the row per acquire."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import (
    PERMIT_TABLE,
    RELEASED,
    SEQUENCE,
    TABLE,
    Dialect,
    permit_listing,
    permit_transaction,
)


class MySQLDialect(Dialect):
    """MariaDB (10.3+: sequences). Acquire is an upsert plus a read of the row."""

    vendor = "mysql"
    _now = "UTC_TIMESTAMP(6)"
    remaining_template = "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {column}) / 1000000.0"
    _remaining = remaining_template.format(column="expires_at")
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
        f"SELECT IF(owner = %s, fence, NULL), IF(owner = %s, NULL, {_remaining}), "
        f"IF(LEFT(owner, 1) = '*', owner, NULL) FROM {TABLE} WHERE `key` = %s",
    )
    # UTC_TIMESTAMP() is read once, when a statement starts: an extend that started before a
    # release but gets the row after it would still find the released row unexpired. It finds
    # no owner of its own there (see Dialect.release_sql), so it cannot bring the lock back.
    release_sql = (
        f"UPDATE {TABLE} SET owner = {RELEASED}, expires_at = {_now} "
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
    # READ COMMITTED for the sweep's deletes (SET TRANSACTION: the next transaction, here
    # that one statement): under REPEATABLE READ a delete by a key that is gone locks the gap
    # there, and inserts of new keys into it would wait. An acquire runs as one statement,
    # which PROCESSLIST shows as executing (with its QUERY_ID) from before it draws its fence
    # until it has committed. A user without the PROCESS privilege sees only its own
    # connections: every process locking through this table must connect as the same user,
    # or have PROCESS.
    sweep_before = ("SET TRANSACTION ISOLATION LEVEL READ COMMITTED",)
    sweep_select = f"SELECT `key` FROM {TABLE} WHERE fence <= %s AND expires_at <= {_now} LIMIT %s"
    sweep_delete = (
        f"DELETE FROM {TABLE} WHERE fence <= %s AND `key` {{names}} AND expires_at <= {_now}"
    )
    _orphan = (
        f"expires_at <= {_now} AND NOT EXISTS "
        f"(SELECT 1 FROM {TABLE} l WHERE l.`key` = {PERMIT_TABLE}.`key`)"
    )
    sweep_permits_select = f"SELECT id FROM {PERMIT_TABLE} WHERE {_orphan} LIMIT %s"
    sweep_permits_delete = f"DELETE FROM {PERMIT_TABLE} WHERE id {{names}} AND {_orphan}"
    sweep_mark_sql = f"SELECT NEXTVAL({SEQUENCE})"
    sweep_busy_sql = (
        "SELECT CONCAT(ID, ':', QUERY_ID) FROM information_schema.PROCESSLIST "
        "WHERE ID <> CONNECTION_ID() AND COMMAND IN ('Query', 'Execute') AND DB = DATABASE()"
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
        now=_now,
        remaining=remaining_template,
        prune=f"DELETE FROM {PERMIT_TABLE} WHERE expires_at <= {_now} LIMIT %s",
    )
    transaction = permit_transaction(
        p="%s",
        key="`key`",
        now=_now,
        until=f"{_now} + INTERVAL %s MICROSECOND",
        greatest="GREATEST",
        next_fence=f"NEXTVAL({SEQUENCE})",
        remaining=remaining_template,
        keep_existing="ON DUPLICATE KEY UPDATE `key` = `key`",
        for_update=" FOR UPDATE",
    )

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, round(ttl * 1_000_000)), (owner, owner, key)]

    def interval(self, seconds: float) -> Any:
        return round(seconds * 1_000_000)  # microseconds

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
