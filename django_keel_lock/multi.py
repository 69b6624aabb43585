"""One handle over several keys, taken all or nothing: `lock(["account:1", "account:2"])`.

A `MultiLock` is a `Lock` whose store operations take its keys (`LockStore.acquire_many`,
`release_many`, `extend_many`): each key is held as an exclusive lock of that key, so a
single-key lock of one of them excludes it and it excludes them. The keys are taken at once
or not at all: a waiter holds none of them while it waits for the rest (it listens for the
releases of every one, and takes no turn of any), so no order of callers can deadlock, and
the order the caller gives does not matter (the keys are sorted; duplicates are one key).

What waiting, releasing, extending, the watchdog and losing mean is the engine's and
`holding.Holding`'s, as for one key (`engine.MANY` is how it asks); this module says only
what differs: the keys, a fence per key, the queries per key, and the token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Unpack

from .core import Lock, multi_locks_with
from .options import LockOptions, LockSpec, refuse_option, validate_keys
from .registry import get_lock_store
from .stores.base import EXCLUSIVE, LockInfo

if TYPE_CHECKING:
    from . import tokens
    from .engine import Outcome
    from .metrics import Meter

__all__ = ["MultiLock"]


class MultiLock(Lock):
    """A handle on several keys of one store, taken all or nothing; not shared between
    threads (make one per worker). Everything a `Lock` has, and:

    - `keys`: the distinct keys, sorted; `key` is them joined with "+" (for logs, signals),
      `name` the same with digits and ids as `*` unless `name=` is given (metrics, traces);
    - `fences`: each key's fence while held (empty when not), each strictly greater than
      every earlier fence of that key; `fence` is the greatest of them;
    - lost (`on_lost`) when any key is lost: the others are then given back;
    - `holders()` and `info()` per key; `is_locked()` when any key is held; `remaining_time()`
      the soonest expiry among its keys.

    Exclusive only: `shared=True` and `limit=` are refused. At most `stores.base.MAX_KEYS`
    distinct keys."""

    __slots__ = ("_fences", "keys")

    many = True
    keys: tuple[str, ...]  # type: ignore[misc]  # a slot here, `Lock`'s (key,) there

    def __init__(self, keys: Sequence[str], **options: Unpack[LockOptions]) -> None:
        """A handle on `keys` taken as the `LockOptions` say; nothing is acquired until
        acquire/run/`with`."""
        self._setup(keys, LockSpec.of("MultiLock", options), label=None)

    @classmethod
    def from_spec(
        cls,
        keys: Sequence[str],
        spec: LockSpec,
        *,
        label: str | None = None,
        raises: bool = False,
    ) -> MultiLock:
        """A handle on `keys` taken as `spec` says (as `Lock.from_spec`: `label` names the
        caller in the holder, `raises` marks a refusal an error in traces)."""
        handle = cls.__new__(cls)
        handle._setup(keys, spec, label=label, raises=raises)
        return handle

    @classmethod
    def of(cls, keys: object, shared: object, options: Mapping[str, object]) -> MultiLock:
        """What `lock(keys, **options)` makes of a list or tuple of keys."""
        if shared is not False:
            raise ValueError(
                "shared=True is not for several keys: a multi-key lock takes its keys "
                "exclusively (drop shared=, or take each key's shared lock on its own)"
            )
        if "limit" in options:
            raise refuse_option(
                "lock", "limit", "a multi-key lock is exclusive; semaphores take one key each"
            )
        return cls.from_spec(keys, LockSpec.of("lock", options))  # type: ignore[arg-type]

    def _setup(
        self, keys: Sequence[str], spec: LockSpec, label: str | None = None, raises: bool = False
    ) -> None:
        if spec.mode is not EXCLUSIVE:
            what = "limit=" if spec.mode.kind == "semaphore" else "shared=True"
            raise ValueError(
                f"{what} is not for several keys: a multi-key lock takes its keys exclusively"
            )
        self.keys = validate_keys(keys, get_lock_store(spec.store))
        # As a handle on its first key (checked again there: a call less for every
        # single-key handle than a setup split in two), then on all of them.
        super()._setup(self.keys[0], spec, label=label, raises=raises)
        self.plain = False  # its store operations take its keys
        self.key = "+".join(self.keys)
        self._fences: tuple[int, ...] = ()

    @property
    def fences(self) -> dict[str, int]:
        """Each key's fence while the handle holds its keys; {} when it does not."""
        return dict(zip(self.keys, self._fences, strict=True)) if self._held else {}

    def _settle(
        self,
        owner: str,
        outcome: Outcome,
        meter: Meter | None,
        wait: float,
        thread: bool,
    ) -> bool:
        result = outcome[0]
        if not isinstance(result, BaseException) and result.fences is not None:
            self._fences = result.fences  # before `lock_acquired` goes out
        return super()._settle(owner, outcome, meter, wait, thread)

    def describe(self) -> str:
        return f"multi-key lock {self.key!r}"

    # -- handing over ---------------------------------------------------------------------
    def _token(self, owner: str, fence: int, expires_at: float) -> tokens.Token:
        token = super()._token(owner, fence, expires_at)
        return token._replace(keys=list(self.keys), fences=list(self._fences))

    @classmethod
    def _restore(cls, data: tokens.Token) -> MultiLock:
        assert data.keys is not None and data.fences is not None
        handle = cls(data.keys, ttl=data.ttl, store=data.store, holder=data.holder)
        fences = dict(zip(data.keys, data.fences, strict=True))
        handle._fences = tuple(fences[key] for key in handle.keys)
        return handle

    # -- what the store says of the keys --------------------------------------------------
    def info(self) -> dict[str, LockInfo | None]:  # type: ignore[override]
        """Each key's holder (with several, the one that expires first), None where free."""
        return {key: _first(self._store.holders(key)) for key in self.keys}

    def holders(self) -> dict[str, list[LockInfo]]:  # type: ignore[override]
        """Each key's current holders, soonest expiry first ([] where free)."""
        return {key: self._store.holders(key) for key in self.keys}

    def is_locked(self) -> bool:
        """Does anyone (not necessarily this handle) hold any of the keys right now?"""
        return any(self._store.get(key) is not None for key in self.keys)

    def remaining_time(self) -> float | None:
        """Seconds until the soonest expiry among the holders of its keys; None when nobody
        holds any of them."""
        return _soonest(self.holders())

    async def ainfo(self) -> dict[str, LockInfo | None]:  # type: ignore[override]
        """`info` for async code."""
        holders = await self.aholders()
        return {key: _first(each) for key, each in holders.items()}

    async def aholders(self) -> dict[str, list[LockInfo]]:  # type: ignore[override]
        """`holders` for async code."""
        found = await asyncio.gather(*(self._store.aholders(key) for key in self.keys))
        return dict(zip(self.keys, found, strict=True))

    async def ais_locked(self) -> bool:
        """`is_locked` for async code."""
        return any((await self.aholders()).values())

    async def aremaining_time(self) -> float | None:
        """`remaining_time` for async code."""
        return _soonest(await self.aholders())

    def __repr__(self) -> str:
        state = f"held fences={self.fences}" if self._held else "not held"
        return f"<MultiLock {self.keys!r} store={self.store_alias!r} {state}>"


def _first(holders: list[LockInfo]) -> LockInfo | None:
    return holders[0] if holders else None


def _soonest(holders: Mapping[str, list[LockInfo]]) -> float | None:
    left = [info.expires_in for each in holders.values() for info in each]
    return min(left) if left else None


multi_locks_with(MultiLock)
