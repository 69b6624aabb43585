"""The database store (moved here from stores/database.py)."""

from .store import PAGE_SIZE, PRUNE_BATCH, DatabaseLockStore, release_channel

__all__ = ["PAGE_SIZE", "PRUNE_BATCH", "DatabaseLockStore", "release_channel"]
