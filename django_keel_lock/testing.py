"""Helpers for a project's own tests: run each test on a fresh in-memory store.

    from django_keel_lock.testing import memory_lock_store

    @memory_lock_store()              # or: with memory_lock_store() as store: ...
    def test_charge(): ...

With pytest, add `pytest_plugins = ["django_keel_lock.testing"]` to conftest.py and request
the `keel_lock_memory_store` fixture.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import ContextDecorator
from typing import Any, TypeVar, cast

from .registry import get_lock_store, lock_store_override, set_lock_store
from .stores.base import LockStore
from .stores.memory import MemoryLockStore

F = TypeVar("F", bound=Callable[..., Any])


class memory_lock_store(ContextDecorator):  # lower case: used like a function
    """Point the given aliases (default: "default") at fresh MemoryLockStores, then restore.

    Each alias gets its own store; entering yields the first one.
    """

    def __init__(self, *aliases: str) -> None:
        self.aliases = aliases or ("default",)
        self._saved: list[dict[str, LockStore | None]] = []

    def __enter__(self) -> MemoryLockStore:
        self._saved.append({alias: lock_store_override(alias) for alias in self.aliases})
        stores = [MemoryLockStore(alias=alias) for alias in self.aliases]
        for store in stores:
            set_lock_store(store, store.alias)
        return stores[0]

    def __exit__(self, *exc_info: object) -> None:
        for alias, previous in self._saved.pop().items():
            set_lock_store(previous, alias)

    def __call__(self, func: F) -> F:
        """Decorate a test; an `async def` one keeps the stores for the whole coroutine (a
        plain ContextDecorator would restore them before its body runs)."""
        if not inspect.iscoroutinefunction(func):
            return super().__call__(func)

        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return await func(*args, **kwargs)

        return cast(F, run)


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional for users
    pass
else:

    @pytest.fixture
    def keel_lock_memory_store() -> Iterator[MemoryLockStore]:
        """A fresh MemoryLockStore as the "default" store for one test."""
        with memory_lock_store() as store:
            yield store


__all__ = ["get_lock_store", "keel_lock_memory_store", "memory_lock_store"]
