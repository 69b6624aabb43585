"""Several keys' exclusive locks in one transaction (MariaDB, SQLite; see
`LockStore.acquire_many`): each key by its single-key statement, in the order of the keys, so
two such transactions lock rows in one order and never wait for each other in a circle.

An acquire takes the keys after a savepoint; when any key is held by another owner it rolls
back to it (no key of the set was taken: nobody outside saw any of it) and raises the
`waiting` flag of each such key where releases push wake-ups (MariaDB), so its release rings
for this waiter as it does for a refused single-key acquire. PostgreSQL does the same in one
function call (migration 0008).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..base import PERMIT_OWNERS, AcquireResult
from .dialects.base import Dialect, InTransaction, PermitTransaction

SAVEPOINT = "keel_lock_many"


class Many(InTransaction):
    """One multi-key operation on `cursor`, inside the transaction the store opened."""

    def __init__(self, dialect: Dialect, permits: PermitTransaction, cursor: Any) -> None:
        super().__init__(dialect, cursor)
        self.dialect, self.permits = dialect, permits

    def acquire(
        self, keys: Sequence[str], owner: str, holder: str, ttl: float, refused_sql: str = ""
    ) -> AcquireResult:
        """Take every one of `keys` for `owner`, or none (see the module's docstring).
        `refused_sql` (key): reads what holds a key whose upsert returned no row (SQLite)."""
        self.cursor.execute(f"SAVEPOINT {SAVEPOINT}")
        fences: list[int] = []
        refusals: list[tuple[str, Any, Any]] = []
        for key in keys:
            fence, retry_in, marker = self._take(key, owner, holder, ttl, refused_sql)
            if fence is None:
                refusals.append((key, retry_in, marker))
            else:
                fences.append(int(fence))
        if not refusals:
            self.cursor.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
            return AcquireResult(max(fences), fences=tuple(fences))
        self.cursor.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        if self.permits.raise_waiting:
            for key, _, _ in refusals:
                self.run(self.permits.raise_waiting, key)
        held_as = PERMIT_OWNERS.get(text(refusals[0][2]) or "", "exclusive")
        soonest = min(seconds(retry_in) or 0.0 for _, retry_in, _ in refusals)
        blocked = tuple(key for key, _, _ in refusals)
        return AcquireResult(None, soonest, held_as, None, blocked)

    def _take(
        self, key: str, owner: str, holder: str, ttl: float, refused_sql: str
    ) -> Sequence[Any]:
        """The single-key acquire of `key`: (fence or None, seconds left, permit marker)."""
        dialect, rows = self.dialect, []
        params = dialect.acquire_params(key, owner, holder, ttl)
        for sql, values in zip(dialect.acquire_sql, params, strict=True):
            rows = self.run(sql, *values)
        if not rows and refused_sql:
            rows = self.run(refused_sql, key)
        if not rows:  # expired since the upsert looked: worth trying again at once
            return (None, 0.0, None)
        return tuple(rows[0][:3])

    def release(self, keys: Sequence[str], owner: str) -> list[tuple[str, bool]]:
        """Release each of `keys` that `owner` holds: (key, someone waited for it) of each."""
        released: list[tuple[str, bool]] = []
        waited = getattr(self.dialect, "released_waiting", None)
        for key in keys:
            self.cursor.execute(self.dialect.release_sql, (key, owner))
            if self.cursor.rowcount > 0:
                released.append((key, bool(waited and waited(self.cursor))))
        return released

    def extend(self, keys: Sequence[str], owner: str, ttl: float) -> int:
        """Extend each of `keys` that `owner` holds; how many it held."""
        extended = 0
        for key in keys:
            self.cursor.execute(
                self.dialect.extend_sql, self.dialect.extend_params(key, owner, ttl)
            )
            extended += self.cursor.rowcount > 0
        return extended


def array_literal(keys: Sequence[str]) -> str:
    """`keys` as a PostgreSQL text[] literal: one parameter, whatever their count and their
    characters (each quoted, its backslashes and quotes escaped)."""
    quoted = ('"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"' for key in keys)
    return "{" + ",".join(quoted) + "}"


def int_array(value: Any) -> list[int]:
    """An integer array as a driver gives it: a list, or its text (`{1,2}`, libpq path)."""
    if value is None:
        return []
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        inner = value.strip("{}")
        return [int(part) for part in inner.split(",")] if inner else []
    return [int(part) for part in value]


def seconds(value: Any) -> float | None:
    """Seconds left as a column gives them: None stays None, a past time is 0."""
    return None if value is None else max(0.0, float(value))


def text(value: Any) -> str | None:
    """A text column's value (the libpq path gives bytes)."""
    return value.decode() if isinstance(value, bytes) else value
