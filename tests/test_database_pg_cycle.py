"""The PostgreSQL uncontended cycle's short cuts under contention, with real connections held
at a point: the release whose WITH frees a lock nobody waits for (migration 0009's function
runs only where it freed nothing), and the retake of the lock a thread freed last (a plain
UPDATE, then the upsert)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.stores import DatabaseLockStore

from .conftest import needs_store
from .test_database_faults import timed, wait_until

pytestmark = needs_store("postgres")


@contextmanager
def _connection(autocommit: bool = False) -> Iterator[Any]:
    """A PostgreSQL connection of the test's own to the stores' database."""
    import psycopg

    settings = connections["postgres"].settings_dict
    with psycopg.connect(
        host=settings["HOST"], port=settings["PORT"], user=settings["USER"],
        dbname=settings["NAME"], autocommit=autocommit,
    ) as raw:  # fmt: skip
        yield raw


def _waits_for_a_row(monitor: Any, text: str) -> bool:
    """Whether a statement whose text has `text` waits for a lock (a row's) now."""
    (count,) = monitor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE %s AND pid <> pg_backend_pid()",
        (f"%{text}%",),
    ).fetchone()
    return bool(count)


#: The stores' SOCKET_TIMEOUT below, and how long each row lock in the way is held.
_TIMEOUT, _HELD = 1.0, 0.8


def _hold_then_let_go(monitor: Any, first: Any, second: Any, key: str) -> None:
    """Let `first`'s lock of `key`'s row go once the retake waits for it, with `second`
    queued for the row behind the retake; `second`'s once the upsert waits for it: each
    after `_HELD` seconds."""
    wait_until(lambda: _waits_for_a_row(monitor, "fence = nextval"), 10)
    queued = threading.Thread(
        target=second.execute,
        args=("SELECT 1 FROM django_keel_lock_lock WHERE key = %s FOR UPDATE", (key,)),
    )
    queued.start()
    wait_until(lambda: _waits_for_a_row(monitor, "FOR UPDATE"), 10)
    time.sleep(_HELD)
    first.commit()
    queued.join(10)
    wait_until(lambda: _waits_for_a_row(monitor, "ON CONFLICT"), _TIMEOUT)
    time.sleep(_HELD)
    second.commit()


@pytest.mark.parametrize("pooler", [False, True], ids=["own-sessions", "pooler"])
def test_postgres_retake_and_its_upsert_wait_at_most_socket_timeout_together(
    key: str, pooler: bool
) -> None:
    """An acquire that tries the retake first, then the upsert, is one call: it waits for
    the server at most SOCKET_TIMEOUT in all, as any call does (docs/stores.md), however
    long each statement waits for the row. Here the retake waits for one holder of the row
    and the upsert for the next, each for most of SOCKET_TIMEOUT: the call ends (refused,
    or LockStoreUnavailable) within SOCKET_TIMEOUT, not twice that."""
    store = DatabaseLockStore(
        "retake-deadline",
        {"DATABASE": "postgres", "SOCKET_TIMEOUT": _TIMEOUT, "TRANSACTION_POOLER": pooler},
    )
    try:
        assert store.acquire(key, "a", "a", 30).acquired
        assert store.release(key, "a")  # this thread's last free release: the retake next
        with _connection() as first, _connection() as second, _connection(True) as monitor:
            first.execute(
                "UPDATE django_keel_lock_lock SET owner = 'x', "
                "expires_at = clock_timestamp() + interval '1 hour' WHERE key = %s",
                (key,),
            )
            referee = threading.Thread(target=_hold_then_let_go, args=(monitor, first, second, key))
            referee.start()
            try:
                result, took = timed(lambda: store.acquire(key, "a", "a", 30))
            finally:
                referee.join(10)
        assert isinstance(result, LockStoreUnavailable) or not result.acquired, result
        assert took < _TIMEOUT + 0.3, f"the acquire took {took:.2f}s ({result!r})"
    finally:
        store.close()
