"""What the store says about a handle's key: its holders, whether it is locked, how long
until it lets the handle in. Read-only questions, one round trip each; none of them changes
the handle (`Holding.is_owned` is the one that does)."""

from __future__ import annotations

from .stores.base import LockInfo, LockStore, Mode

__all__ = ["KeyQueries"]


class KeyQueries:
    """The key's questions of `core.Lock` (a mixin: the handle keeps `key`, `mode` and its
    store)."""

    __slots__ = ()

    key: str
    mode: Mode
    _store: LockStore

    def info(self) -> LockInfo | None:
        """The key's holder (ours or another's; with several, the one that expires first),
        or None if it is free."""
        info = self._store.get(self.key)
        if info is not None and info.is_gate:
            return _first(self._store.holders(self.key))
        return info

    def holders(self) -> list[LockInfo]:
        """Every current holder of the key (each permit, with its mode), soonest expiry
        first; [] when it is free."""
        return self._store.holders(self.key)

    def is_locked(self) -> bool:
        """Does anyone (not necessarily this handle) hold the key right now?"""
        return self._store.get(self.key) is not None

    def remaining_time(self) -> float | None:
        """Seconds until the key, as it is held now, lets this handle in by expiries alone
        (what a Retry-After says), None when nobody holds it. A semaphore needs one permit
        freed: the soonest holder's expiry. A lock needs every holder gone (a writer waits for
        the last reader; a reader for the writer, or the readers ahead of a writer that
        waits): the latest expiry."""
        info = self._store.get(self.key)
        if info is None or not info.is_gate:
            return None if info is None else info.expires_in
        left = [holder.expires_in for holder in self._store.holders(self.key)]
        pick = min if self.mode.kind == "semaphore" else max
        return pick(left) if left else None

    async def ainfo(self) -> LockInfo | None:
        """`info` for async code: the key's (first) holder, or None if it is free."""
        info = await self._store.aget(self.key)
        if info is not None and info.is_gate:
            return _first(await self._store.aholders(self.key))
        return info

    async def aholders(self) -> list[LockInfo]:
        """`holders` for async code."""
        return await self._store.aholders(self.key)

    async def ais_locked(self) -> bool:
        """`is_locked` for async code: does anyone hold the key right now?"""
        return await self._store.aget(self.key) is not None

    async def aremaining_time(self) -> float | None:
        """`remaining_time` for async code: seconds until the key lets this handle in, or None."""
        info = await self._store.aget(self.key)
        if info is None or not info.is_gate:
            return None if info is None else info.expires_in
        left = [holder.expires_in for holder in await self._store.aholders(self.key)]
        pick = min if self.mode.kind == "semaphore" else max
        return pick(left) if left else None


def _first(holders: list[LockInfo]) -> LockInfo | None:
    """The holder that expires first (the store lists them so), None if there is none."""
    return holders[0] if holders else None
