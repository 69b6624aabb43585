"""The database store: `store` (DatabaseLockStore), `dialects` (each vendor's SQL), `libpq`
(PostgreSQL's fast path) and `listener` (PostgreSQL's LISTEN)."""

from __future__ import annotations

from .store import PAGE_SIZE, PRUNE_BATCH, DatabaseLockStore

__all__ = ["PAGE_SIZE", "PRUNE_BATCH", "DatabaseLockStore"]
