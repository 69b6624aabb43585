"""The etcd store: `store` (EtcdLockStore), `client` (etcd's JSON gateway on http.client),
`listener` (a watch of the lock keys) and `checks` (its system checks). It needs no package
beyond Django."""

from __future__ import annotations

from .store import EtcdLockStore

__all__ = ["EtcdLockStore"]
