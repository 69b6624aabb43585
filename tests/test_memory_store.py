"""The memory store's own mutex: other threads wait for it, and an error under it frees it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from django_keel_lock.stores.base import AcquireResult
from django_keel_lock.stores.memory import MemoryLockStore


class SlowFences(Iterator[int]):
    """Fences drawn slowly: the thread drawing one sleeps while it holds the store's mutex."""

    def __init__(self) -> None:
        self.fences = itertools.count(1)

    def __next__(self) -> int:
        time.sleep(0.01)
        return next(self.fences)


class SlowStore(MemoryLockStore):
    def __init__(self) -> None:
        super().__init__()
        self._fences = SlowFences()


def test_threads_racing_for_a_key_wait_for_the_mutex_and_one_gets_it() -> None:
    store, racers = SlowStore(), 6
    start = threading.Barrier(racers)
    results: list[AcquireResult] = []

    def race(owner: str) -> None:
        start.wait()
        results.append(store.acquire("raced", owner, "racer", 30))

    threads = [threading.Thread(target=race, args=(f"owner-{i}",)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == racers
    assert [result.fence for result in results if result.acquired] == [1]


def test_an_error_under_the_mutex_leaves_it_free_for_the_next_call() -> None:
    store = MemoryLockStore()
    with pytest.raises(TypeError):
        store.acquire("k", "first", "h", "30")  # type: ignore[arg-type]  # raises under the mutex
    results: list[AcquireResult] = []
    worker = threading.Thread(
        target=lambda: results.append(store.acquire("k", "next", "h", 30)), daemon=True
    )
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the mutex was left taken"
    assert results[0].acquired


def test_a_grant_is_a_whole_acquire_result_equal_to_one_made_by_hand() -> None:
    # The store builds its grants without the named tuple's __new__: they must still have
    # every field (a short tuple's last_fence raised IndexError, and compared unequal).
    store = MemoryLockStore()
    taken = store.acquire("whole", "owner", "h", 30)
    again = store.acquire("whole", "owner", "h", 30)  # the same owner's retry
    assert store.release("whole", "owner")
    store.acquire("other", "owner", "h", 0.001)
    time.sleep(0.01)
    expired = store.acquire("other", "next", "h", 30)  # an expired lock taken over
    for grant in (taken, again, expired):
        assert grant == AcquireResult(grant.fence)
        assert grant.last_fence is None and grant.blocked == ()
