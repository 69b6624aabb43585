"""The permit operations where the store decides them, each one transaction (MariaDB, SQLite).

Each reads the key's lock row, locked, with its permit rows (`PermitTransaction.read`), asks
`stores.permits.plan_acquire` (acquire) and writes what it says. PostgreSQL makes the same
decisions in the functions of migration 0003 instead, in one round trip.

Each permit is a slot of its key (see `models.Permit`), live only while the lock row is owned
by a PERMIT_OWNERS marker and unexpired and the slot itself unexpired and not released: the
slots of a key whose lock expired (and may since have been taken) are all free. A grant fills
the lowest free slot, a release expires its own; no operation here deletes one (prune does).
The rows `read` returns stay locked until COMMIT (MariaDB's FOR UPDATE, SQLite's one writer),
so prune cannot delete a slot between the read and the write.

Where releases push wake-ups (MariaDB), a refusal raises the lock row's `waiting` flag and a
release says whether it found it raised, for the store to ring the key's doorbell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..base import GATE_OWNER, PERMIT_OWNERS, AcquireResult, Mode
from ..permits import Held, Step, plan_acquire
from .dialects import Dialect
from .dialects.base import InTransaction, PermitTransaction


class _Slot(NamedTuple):
    slot: int
    owner: str
    left: float
    fence: int
    expires_at: Any  # as the driver reads it, to write back


class _Key:
    """A key's lock row and permit slots as `read` returned them."""

    def __init__(self, rows: Sequence[Sequence[Any]]) -> None:
        first = rows[0]
        self.owner: str = first[0]
        self.left = float(first[1] or 0.0)
        self.writer: str | None = first[2]
        self.writer_left = float(first[3] or 0.0)
        self.fence = int(first[4])
        self.waiting = bool(first[10])  # someone was refused since the last take or release
        self.gated = self.owner in PERMIT_OWNERS and self.left > 0
        self.slots = [
            _Slot(int(r[5]), r[6], float(r[7] or 0.0), int(r[8]), r[9])
            for r in rows
            if r[5] is not None
        ]
        self.permits = [s for s in self.slots if s.owner and s.left > 0] if self.gated else []

    def held(self) -> Held:
        return Held(
            self.owner,
            self.left,
            self.writer,
            self.writer_left,
            [(p.owner, p.left) for p in self.permits],
        )

    def permit(self, owner: str) -> _Slot | None:
        return next((p for p in self.permits if p.owner == owner), None)

    def free_slot(self) -> int | None:
        """The lowest slot that holds no live permit; None when every slot does."""
        live = {p.slot for p in self.permits}
        return min((s.slot for s in self.slots if s.slot not in live), default=None)

    def new_slot(self) -> int:
        return max((s.slot for s in self.slots), default=-1) + 1


class Transaction(InTransaction):
    """One permit operation's statements on `cursor`, inside the transaction the store opened."""

    def __init__(self, dialect: Dialect, sql: PermitTransaction, cursor: Any) -> None:
        self.sql = sql
        super().__init__(dialect, cursor)

    def read(self, key: str) -> _Key | None:
        rows = self.run(self.sql.read, key)
        return _Key(rows) if rows else None

    def next_fence(self) -> int:
        return int(self.run(self.sql.next_fence)[0][0])

    def acquire(
        self, key: str, owner: str, holder: str, ttl: float, mode: Mode, writer_wait: float
    ) -> AcquireResult:
        sql, interval = self.sql, self.interval
        self.run(sql.ensure_row, key)
        found = self.read(key)
        assert found is not None  # ensure_row made it, and holds it
        plan = plan_acquire(found.held(), owner, mode)
        refused = AcquireResult(None, plan.retry_in, plan.held_as)
        if plan.step in (Step.REFUSE, Step.INTEND):
            if plan.step is Step.INTEND and (
                found.writer is None or found.writer_left <= 0 or found.writer == owner
            ):
                self.run(sql.set_writer, owner, interval(writer_wait), key)
            if sql.raise_waiting and not found.waiting:
                self.run(sql.raise_waiting, key)
            return refused
        if plan.step is Step.TAKE:
            if found.writer == owner:
                self.run(sql.clear_writer, key)
            if found.owner == owner and found.left > 0:
                self.run(sql.renew, interval(ttl), key)
                return AcquireResult(found.fence)
            fence = self.next_fence()
            self.run(sql.take, owner, holder, fence, interval(ttl), key)
            return AcquireResult(fence)
        if plan.step is Step.RENEW:
            mine = found.permit(owner)
            assert mine is not None
            self.run(sql.renew_permit, interval(ttl), key, mine.slot)
            self.run(sql.widen_gate, mine.fence, interval(ttl), key)
            return AcquireResult(mine.fence)
        # GRANT. The gate is written after the permit, so its clock reads later: its expiry is
        # never before the permit's.
        fence = self.next_fence()
        slot = found.free_slot()
        if slot is None:
            self.run(sql.insert_permit, key, found.new_slot(), owner, holder, fence, interval(ttl))
        else:
            self.run(sql.fill_slot, owner, holder, fence, interval(ttl), key, slot)
        if found.gated:
            self.run(sql.widen_gate, fence, interval(ttl), key)
        else:
            self.run(sql.open_gate, GATE_OWNER[mode.kind], fence, interval(ttl), key)
        return AcquireResult(fence)

    def held_by_permits(self, key: str) -> _Key | None:
        """The key, read and locked, if permits hold it."""
        found = self.read(key)
        return found if found is not None and found.gated else None

    def release(self, key: str, owner: str) -> tuple[bool, bool]:
        """(released, whether someone waited for the key: see the module's docstring)."""
        sql = self.sql
        found = self.held_by_permits(key)
        mine = None if found is None else found.permit(owner)
        if found is None or mine is None:
            return False, False
        self.run(sql.release_slot, key, mine.slot)
        others = [p for p in found.permits if p.owner != owner]
        if others:
            # The rows read stay locked until COMMIT: the latest of the others is still the
            # latest.
            self.run(sql.gate_until, max(p.expires_at for p in others), key)
        else:
            self.run(sql.free, key)
        return True, found.waiting

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        found = self.held_by_permits(key)
        mine = None if found is None else found.permit(owner)
        if mine is None:
            return False
        self.run(self.sql.extend_permit, self.interval(ttl), key, mine.slot)
        self.run(self.sql.widen_gate, mine.fence, self.interval(ttl), key)
        return True
