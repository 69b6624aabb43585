"""The database store under faults: a frozen server never hangs a call (SOCKET_TIMEOUT), and a
release that returned True is never undone by an extend that raced it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from django_keel_lock.stores import DatabaseLockStore

from .conftest import DATABASE_STORES, database_of, store_params

#: Races per database. SQLite runs one writer at a time (the race cannot happen there): fewer
#: rounds keep the same contract checked without its slow commits dominating the run.
RACES = {"sqlite": 500, "postgres": 2000, "mariadb": 2000}


def spin(seconds: float) -> None:
    """Busy-wait `seconds` (sleep() is too coarse for a fraction of a millisecond)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("alias", store_params(DATABASE_STORES))
def test_extend_racing_a_release_never_brings_the_released_lock_back(alias: str) -> None:
    """Release and extend of one owner's lock, sent at nearly the same moment from two threads,
    RACES times: after every release that returned True the key is free. (MariaDB reads its clock
    once per statement: an extend that started before the release but reached the row after it
    used to find the released row "still valid" and extend it by its ttl.)"""
    store = DatabaseLockStore(f"race-{alias}", {"DATABASE": database_of(alias)})
    owner, prefix, races = "o" * 32, f"race:{uuid.uuid4().hex[:12]}", RACES[alias]
    keys = [f"{prefix}:{n}" for n in range(races)]
    released: list[bool] = [False] * races
    errors: list[BaseException] = []
    start = threading.Barrier(2, timeout=30)

    def racer(release: bool) -> None:
        try:
            for n, key in enumerate(keys):
                start.wait()
                if release:
                    released[n] = store.release(key, owner)
                else:
                    spin(n % 30 * 0.0001)  # the release got ahead by 0 to 3 ms: its commit
                    store.extend(key, owner, 60)
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    try:
        for key in keys:
            assert store.acquire(key, owner, "racer", 60).acquired
        threads = [threading.Thread(target=racer, args=(side,)) for side in (True, False)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        assert all(released), "a release that raced an extend of its own lock found no lock"
        held = [key for key in keys if store.get(key) is not None]
        assert not held, f"{len(held)} of {races} keys released with True are still held"
        taken = [key for key in keys if not store.acquire(key, "n" * 32, "next", 1).acquired]
        assert not taken, f"{len(taken)} of {races} keys released with True cannot be acquired"
    finally:
        store.close()
