"""What a permit acquire does, decided once for the stores that decide in Python.

The memory store and the database store's transactional path (MariaDB, SQLite) read a key's
lock, its waiting writer and its permits, ask `plan_acquire`, and carry out the plan; the
PostgreSQL function and the Redis script make the same decisions in the server's own
language (their comments point here). The rules:

- An exclusive holder excludes every permit; permits of one kind exclude the other kind and
  exclusive acquirers (their key's lock is held by the kind's GATE_OWNER).
- A shared permit is refused while a writer waits (`writer`, until its wait ends), so readers
  arriving one after another cannot keep a writer out for ever.
- A semaphore permit is refused while `mode.limit` permits live.
- The same owner asking again gets its own permit (or lock) back.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from .base import PERMIT_OWNERS, Kind, Mode


class Step(Enum):
    GRANT = "grant"  # a new permit, with a new fence
    RENEW = "renew"  # the owner's live permit, ttl renewed, same fence
    TAKE = "take"  # exclusive: the key's lock, as `LockStore.acquire` takes it
    INTEND = "intend"  # exclusive, refused by readers: record the writer waiting
    REFUSE = "refuse"


class Plan(NamedTuple):
    step: Step
    held_as: Kind | None = None  # refused: how the key is held
    retry_in: float | None = None  # refused: seconds until the soonest holder's expiry


class Held(NamedTuple):
    """One key as a store read it: its lock's owner and seconds left (None when free:
    absent, released or expired), the waiting writer's owner and seconds left, and each live
    permit's (owner, seconds left)."""

    owner: str | None
    left: float
    writer: str | None
    writer_left: float
    permits: Sequence[tuple[str, float]]


def plan_acquire(held: Held, owner: str, mode: Mode) -> Plan:
    """What an acquire of `owner` in `mode` does to the key `held` describes."""
    kind = _held_as(held)
    permits = [(o, left) for o, left in held.permits if left > 0]
    soonest = min((left for _, left in permits), default=held.left)
    if mode.kind == "exclusive":
        return _plan_exclusive(held, owner, kind, soonest)
    if kind == "exclusive":
        return Plan(Step.REFUSE, "exclusive", held.left)
    if kind is not None and kind != mode.kind:
        return Plan(Step.REFUSE, kind, soonest)
    if any(o == owner for o, _ in permits):
        return Plan(Step.RENEW)
    return _plan_new_permit(held, mode, len(permits), soonest)


def _held_as(held: Held) -> Kind | None:
    """How the key is held: by its lock's live owner, a PERMIT_OWNERS marker telling the
    permits' kind; None when it is free."""
    live = held.owner is not None and held.left > 0
    return PERMIT_OWNERS.get(held.owner or "", "exclusive") if live else None


def _plan_exclusive(held: Held, owner: str, kind: Kind | None, soonest: float) -> Plan:
    """An exclusive acquire: the key's lock if it is free or already `owner`'s; where readers
    hold it, the writer's wait is recorded."""
    if kind is None or held.owner == owner:
        return Plan(Step.TAKE)
    if kind == "shared":
        return Plan(Step.INTEND, "shared", soonest)
    return Plan(Step.REFUSE, kind, held.left if kind == "exclusive" else soonest)


def _plan_new_permit(held: Held, mode: Mode, count: int, soonest: float) -> Plan:
    """A permit for an owner that holds none, where `count` permits of its kind live: refused
    while a writer waits (shared) or the limit is reached (semaphore)."""
    writer_waits = held.writer is not None and held.writer_left > 0
    if mode.kind == "shared" and writer_waits:
        return Plan(Step.REFUSE, "exclusive", held.writer_left)
    if mode.kind == "semaphore" and count >= mode.limit:
        return Plan(Step.REFUSE, "semaphore", soonest)
    return Plan(Step.GRANT)
