"""SQLite: one writer at a time, so fences come from MAX(fence) + 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import INFO, RELEASED, TABLE, Dialect


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
        RETURNING fence, NULL
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

    @staticmethod
    def _modifier(ttl: float) -> str:
        return f"+{ttl:.3f} seconds"

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, self._modifier(ttl))]

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (self._modifier(ttl), key, owner)
