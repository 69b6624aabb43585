"""The line of waiters for a key's exclusive lock, where a waiting acquire was refused once
(PostgreSQL, MariaDB; see `LockStore.acquire_queued`): one transaction, decided here.

It locks the key's lock row first (creating it, free, if it is gone), so the attempts of one
key's waiters run one at a time, and then reads the line, rows of `models.Waiter` in the order
of arrival; a place is live until its lease (QUEUE_LEASE from its waiter's last attempt) runs
out, all by the database's clock. The lock row stays locked until COMMIT, and every fence is
drawn while it is. A free lock goes to the first live waiter, or to anyone while the line is
empty; every other refusal keeps the caller's place (or gives it one at the end) and raises
the row's `waiting` flag, so that the release looks at the line and wakes its first.
"""

from __future__ import annotations

from typing import Any

from ..base import PERMIT_OWNERS, QUEUE_LEASE, AcquireResult
from .dialects.base import InTransaction, LineStatements, ServerDialect


class Line(InTransaction):
    """One attempt of a waiter in a key's line, on `cursor`, inside the transaction the store
    opened."""

    def __init__(self, dialect: ServerDialect, cursor: Any) -> None:
        self.sql: LineStatements = dialect.line
        self.last_fence_sql = dialect.line_last_fence_sql
        self.last_fence_from_row = dialect.line_last_fence_from_row
        super().__init__(dialect, cursor)

    def _lock_row(self, key: str) -> tuple[str, float, bool, int]:
        """(owner, seconds left, waiting, fence) of key's lock row, which stays locked. A row
        that is gone is inserted free; one deleted between that insert's check and the read
        (the clean-up deletes free rows) is inserted again."""
        sql = self.sql
        while True:
            rows = self.run(sql.lock, key)
            if rows:
                owner, left, waiting, fence = rows[0][:4]
                return owner, float(left or 0.0), bool(waiting), int(fence)
            self.run(sql.ensure_row, key)

    def acquire(
        self, key: str, owner: str, holder: str, ttl: float, address: str, listener: int | None
    ) -> tuple[AcquireResult, bool]:
        """The attempt's result, and whether `owner` is in the line after it (its process
        reached at `address`, listening on the server's connection `listener`)."""
        lock_owner, lock_left, waiting, lock_fence = self._lock_row(key)
        line = self._line(key, owner, lock_owner)
        live = [place for place in line if place[1] > 0]
        mine = next((left for waiter, left in line if waiter == owner), None)
        held = lock_left > 0
        if held and lock_owner in PERMIT_OWNERS:  # not queued: as acquire says it
            return AcquireResult(None, lock_left, PERMIT_OWNERS[lock_owner]), mine is not None
        first = live[0] if live else None
        if _takes(owner, held, lock_owner, first):
            return self._take(key, owner, holder, ttl, live, mine), False
        self._keep_place(key, owner, address, mine, (holder, ttl, listener))
        if not waiting:
            self.run(self.sql.raise_waiting, key)
        # Held: ask again when it expires (a release wakes us sooner if we are first). Free,
        # someone else first: when that one's place lapses, if it does not take the lock.
        left = lock_left if held else first[1] if first is not None else 0.0
        refused = AcquireResult(
            None, min(left, QUEUE_LEASE), "exclusive", last_fence=self._last(lock_fence)
        )
        return refused, True

    def _last(self, lock_fence: int) -> int | None:
        """The last fence drawn, read while the key's row is locked (a release that hands
        the lock over to this waiter locks it after this transaction: its fence is greater),
        or the row's own `lock_fence` where the dialect says so; None where releases carry
        no grants."""
        if self.last_fence_from_row:
            return lock_fence
        if self.last_fence_sql is None:
            return None
        return int(self.run(self.last_fence_sql)[0][0])

    def _line(self, key: str, owner: str, lock_owner: str) -> list[tuple[str, float]]:
        """Key's line as read, (waiter, seconds left) in the order of arrival; the places of
        others that lapsed are deleted from the table. A place marked with the fence a
        release handed it whose waiter no longer owns the lock (it took the grant with no
        call and released it, or it was passed on) is over: 0 left, not deleted here."""
        line = [
            (row[0], 0.0 if row[2] is not None and row[0] != lock_owner else float(row[1] or 0))
            for row in self.run(self.sql.line, key)
        ]
        if any(left <= 0 and waiter != owner for waiter, left in line):
            # Places that lapsed (a waiter that gave up or died, or one a MariaDB take
            # lapsed): gone now, so that the line's reads do not step over them until the
            # clean-up's round. Its own lapsed place goes in `_take` or `_keep_place`.
            self.run(self.sql.drop_lapsed, key, owner)
        return line

    def _take(
        self,
        key: str,
        owner: str,
        holder: str,
        ttl: float,
        live: list[tuple[str, float]],
        mine: float | None,
    ) -> AcquireResult:
        """The lock is `owner`'s, with a new fence (as acquire does for its owner, taking it
        again draws one); its place, if it has one, goes. The flag stays raised while others
        wait: their turn comes with the next release."""
        sql = self.sql
        (fence,) = self.run(sql.next_fence)[0]
        others = any(waiter != owner for waiter, _ in live)
        self.run(sql.take, owner, holder, fence, self.interval(ttl), others or None, key)
        if mine is not None:
            self.run(sql.leave, key, owner)
        return AcquireResult(int(fence))

    def _keep_place(
        self, key: str, owner: str, address: str, mine: float | None, grant: tuple[Any, ...]
    ) -> None:
        """`owner` keeps its live place for another lease, or (new, or its place lapsed) goes
        to the end of the line; with `grant` (holder, ttl, listener), what a release that
        hands the lock over to it reads."""
        sql = self.sql
        lease = self.interval(QUEUE_LEASE)
        if mine is not None and mine > 0:
            self.run(sql.stay, address, lease, *grant, key, owner)
            return
        if mine is not None:
            self.run(sql.leave, key, owner)
        self.run(sql.join, key, owner, address, lease, *grant)


def _takes(owner: str, held: bool, lock_owner: str, first: tuple[str, float] | None) -> bool:
    """Whether `owner` takes the lock now: it holds it already, or the lock is free and
    `owner` is first in the line, or the line is empty."""
    if held:
        return lock_owner == owner
    return first is None or first[0] == owner
