"""SQLite: one writer at a time, so fences come from MAX(fence) + 1."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from django.db import connections

from .base import INFO, Dialect, permit_listing, permit_transaction
from .schema import PERMIT_TABLE, RELEASED, TABLE


class SQLiteDialect(Dialect):
    """SQLite serialises writers, so MAX(fence) + 1 inside the upsert is race-free."""

    vendor = "sqlite"
    _now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    remaining_template = "(julianday({column}) - julianday('now')) * 86400.0"
    _remaining = remaining_template.format(column="expires_at")
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
        RETURNING fence, NULL, NULL
        """,
    )
    release_sql = (
        f"UPDATE {TABLE} SET owner = {RELEASED}, expires_at = {_now} "
        f"WHERE key = ? AND owner = ? AND expires_at > {_now}"
    )
    extend_sql = f"""
        UPDATE {TABLE}
        SET expires_at = max(expires_at, strftime('%Y-%m-%d %H:%M:%f', 'now', ?))
        WHERE key = ? AND owner = ? AND expires_at > {_now}
    """
    get_sql = (
        f"SELECT {INFO.format(remaining=_remaining)} FROM {TABLE} "
        f"WHERE key = ? AND expires_at > {_now}"
    )
    page_sql = (
        f"SELECT {INFO.format(remaining=_remaining)} FROM {TABLE} "
        f"WHERE key > ? AND substr(key, 1, ?) = ? AND expires_at > {_now} ORDER BY key LIMIT ?"
    )
    # The row with the highest fence stays: MAX(fence) + 1 must never go back. No guard: an
    # acquire computes its fence inside its own write, and SQLite runs one write at a time.
    prune_sql = (
        f"DELETE FROM {TABLE} WHERE key IN (SELECT key FROM {TABLE} WHERE expires_at <= {_now} "
        f"AND fence < (SELECT MAX(fence) FROM {TABLE}) LIMIT ?)"
    )

    # The sweep, likewise, keeps the row with the highest fence.
    _below_top = f"fence < (SELECT MAX(fence) FROM {TABLE})"
    sweep_select = f"SELECT key FROM {TABLE} WHERE expires_at <= {_now} AND {_below_top} LIMIT ?"
    sweep_delete = (
        f"DELETE FROM {TABLE} WHERE key {{names}} AND expires_at <= {_now} AND {_below_top}"
    )
    _orphan = (
        f"expires_at <= {_now} AND NOT EXISTS "
        f"(SELECT 1 FROM {TABLE} l WHERE l.key = {PERMIT_TABLE}.key)"
    )
    sweep_permits_select = f"SELECT id FROM {PERMIT_TABLE} WHERE {_orphan} LIMIT ?"
    sweep_permits_delete = f"DELETE FROM {PERMIT_TABLE} WHERE id {{names}} AND {_orphan}"

    # The upsert returns no row when it refuses: this reads what it found (see
    # `vendors.SQLite.refused`).
    refused_sql = (
        f"SELECT NULL, {_remaining}, CASE WHEN substr(owner, 1, 1) = '*' THEN owner END "
        f"FROM {TABLE} WHERE key = ? AND expires_at > {_now}"
    )

    # Permits: one transaction, decided in Python (`database.permits`); BEGIN IMMEDIATE takes
    # the one writer's place at once, so the rows read stay as read until COMMIT. The gate
    # row carries the latest permit's fence, so MAX(fence) + 1 over the lock table stays
    # above every permit's.
    begin_sql = "BEGIN IMMEDIATE"
    permit_listing = permit_listing(
        p="?",
        key="key",
        now=_now,
        remaining=remaining_template,
        prune=f"DELETE FROM {PERMIT_TABLE} WHERE id IN (SELECT id FROM {PERMIT_TABLE} "
        f"WHERE expires_at <= {_now} LIMIT ?)",
    )
    transaction = permit_transaction(
        p="?",
        key="key",
        now=_now,
        until="strftime('%Y-%m-%d %H:%M:%f', 'now', ?)",
        greatest="max",
        next_fence=_next_fence,
        remaining=remaining_template,
        keep_existing="ON CONFLICT (key) DO NOTHING",
        for_update="",
    )

    def interval(self, seconds: float) -> Any:
        return f"+{seconds:.3f} seconds"  # a strftime modifier

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, self.interval(ttl))]

    def callers_transaction(self, database: str) -> Any:
        """The calling thread's Django connection to the same file while it is in a transaction.

        SQLite lets one connection write to a file at a time, and a transaction that wrote (or,
        with a rollback journal, read) keeps that right to its end: the store's own connection
        would wait for it (the busy timeout, 5 s), then fail, and a release made after the
        caller's write would leave the lock held for its ttl. The caller's own connection is
        the one that can write, so lock statements join its transaction: visible to others
        when it commits (they cannot write before then anyway), undone if it rolls back.
        """
        file = None
        for wrapper in connections.all(initialized_only=True):
            raw = wrapper.connection
            if raw is None or wrapper.vendor != "sqlite" or not raw.in_transaction:
                continue
            if file is None:
                file = _file(connections[database].settings_dict["NAME"])
            if _file(wrapper.settings_dict["NAME"]) == file:
                return raw
        return None


def _file(name: Any) -> str:
    """A database NAME as one spelling per file (":memory:" and URIs come out as themselves,
    prefixed alike)."""
    return str(os.path.realpath(os.fspath(name)))
