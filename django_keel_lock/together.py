"""Which keys one holder holds together: the keys of a multi-key lock (`lock([...])`) are
exclusive locks of each key with the same owner token, so rows of different keys with one
owner are one acquisition. `manage.py locks` and the admin show them as one holder of several
keys; the owner token itself is never shown.

Reading it costs a scan of the store's locks (`LockStore.iter_locks`): a store keeps no index
of owners."""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Iterable, Iterator

from .core import force_release
from .stores.base import LockInfo, LockStore

__all__ = ["OwnerDigests", "held_together", "held_with", "keys_with"]


def _digest(owner: str) -> int:
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=8).digest(), "big")


def _is_lock(info: LockInfo) -> bool:
    """A lock of one owner (permits each have their own owner; a gate is no holder)."""
    return info.mode == "exclusive" and not info.is_gate


def held_with(
    store: LockStore, owners: Iterable[str], prefix: str = ""
) -> dict[str, list[LockInfo]]:
    """The locks of each of `owners` that holds more than one key (in key order), from one
    scan of the locks whose key starts with `prefix`; memory: those locks only."""
    wanted = set(owners)
    found: dict[str, list[LockInfo]] = {}
    if not wanted:
        return found
    for info in store.iter_locks(prefix):
        if info.owner in wanted and _is_lock(info):
            found.setdefault(info.owner, []).append(info)
    return {owner: infos for owner, infos in found.items() if len(infos) > 1}


def keys_with(info: LockInfo, together: dict[str, list[LockInfo]]) -> tuple[str, ...]:
    """The other keys `info`'s holder holds with it (`together`: from `held_with`)."""
    return tuple(each.key for each in together.get(info.owner, []) if each.key != info.key)


def release_others(
    alias: str,
    info: LockInfo,
    together: dict[str, list[LockInfo]],
    user: object | None = None,
) -> list[LockInfo]:
    """Force-release the other keys `info`'s holder holds with it (`together`: from
    `held_with`), each by its fence, in the store `alias`, as `user`; those freed (a key
    released or taken again meanwhile is left alone)."""
    freed = []
    for other in together.get(info.owner, []):
        if other.key != info.key:
            also = force_release(other.key, store=alias, user=user, fence=other.fence)
            if also is not None:
                freed.append(also)
    return freed


class OwnerDigests:
    """8 bytes per lock seen (a digest of its owner), so a streaming listing can tell, once
    done, whether some owner held more than one of the keys it listed."""

    def __init__(self) -> None:
        self.digests = array("Q")

    def seen(self, infos: Iterable[LockInfo]) -> Iterator[LockInfo]:
        """`infos`, passed through, each lock's owner recorded."""
        for info in infos:
            if _is_lock(info):
                self.digests.append(_digest(info.owner))
            yield info

    def repeated(self) -> set[int]:
        """The digests seen more than once (an owner holding several keys; or, once in 2**64,
        two owners that share a digest: `held_together` then finds one key each, no group)."""
        ordered = sorted(self.digests)
        return {a for a, b in itertools.pairwise(ordered) if a == b}


def held_together(
    store: LockStore, digests: OwnerDigests, prefix: str = ""
) -> list[list[LockInfo]]:
    """The holders of several of the keys starting with `prefix` (each: its locks in key
    order), in the order of their first key; one more scan, made only when a listing that
    recorded `digests` saw an owner twice."""
    repeated = digests.repeated()
    if not repeated:
        return []
    groups: dict[str, list[LockInfo]] = {}
    for info in store.iter_locks(prefix):
        if _is_lock(info) and _digest(info.owner) in repeated:
            groups.setdefault(info.owner, []).append(info)
    return [infos for infos in groups.values() if len(infos) > 1]
