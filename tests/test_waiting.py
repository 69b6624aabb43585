"""Waiting threads of one process take turns: a release wakes one of them, not all."""

from __future__ import annotations

import threading
import time

import pytest

from django_keel_lock import lock, set_lock_store
from django_keel_lock.stores import AcquireResult, MemoryLockStore
from django_keel_lock.testing import memory_lock_store

from .conftest import ALL_STORES


class CountingMemoryStore(MemoryLockStore):
    """A real MemoryLockStore that also counts the acquire attempts it answers."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.attempts = 0

    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        self.attempts += 1
        return super().acquire(key, owner, holder, ttl)


def test_a_release_wakes_one_waiting_thread_not_all(key: str) -> None:
    store = CountingMemoryStore()
    set_lock_store(store, "counting")
    try:
        holder = lock(key, store="counting", ttl=30)
        assert holder.acquire()
        waiters = 20
        got: list[int] = []

        def wait_then_release(index: int) -> None:
            handle = lock(key, store="counting", ttl=30)
            assert handle.acquire(timeout=30, retry_delay=5)  # only push wakes them in time
            got.append(index)
            time.sleep(0.005)
            assert handle.release()

        threads = [threading.Thread(target=wait_then_release, args=(i,)) for i in range(waiters)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        store.attempts = 0
        assert holder.release()
        for thread in threads:
            thread.join(30)
        assert sorted(got) == list(range(waiters))
        # Each handoff costs the next thread in line an attempt or two, not every waiter one.
        assert store.attempts <= 3 * waiters, store.attempts
    finally:
        set_lock_store(None, "counting")


@pytest.mark.parametrize("alias", ALL_STORES)
def test_many_threads_on_one_key_all_get_it_in_turn_without_overlap(alias: str, key: str) -> None:
    inside = 0
    overlaps: list[int] = []
    done: list[int] = []
    guard = threading.Lock()

    def worker(index: int) -> None:
        nonlocal inside
        handle = lock(key, store=alias, ttl=30)
        assert handle.acquire(timeout=60)
        with guard:
            inside += 1
            overlaps.append(inside)
        time.sleep(0.002)
        with guard:
            inside -= 1
        assert handle.release()
        done.append(index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert sorted(done) == list(range(16))
    assert max(overlaps) == 1


def test_a_forked_child_is_not_blocked_by_its_parents_waiting_threads(key: str) -> None:
    import os

    with memory_lock_store():
        holder = lock(key, ttl=30)
        assert holder.acquire()
        waiting = threading.Thread(target=lambda: lock(key).acquire(timeout=3))
        waiting.start()
        time.sleep(0.2)  # the thread holds this key's turn while it waits
        pid = os.fork()
        if pid == 0:
            # The child's copy of the store still has the holder's lock: free it there. The
            # child's acquire must not then wait for a turn held by a thread it does not have.
            from django_keel_lock import get_lock_store

            get_lock_store().force_release(key)
            started = time.monotonic()
            got = lock(key).acquire(timeout=2)
            os._exit(0 if got and time.monotonic() - started < 1 else 1)
        _, status = os.waitpid(pid, 0)
        waiting.join()
        assert os.waitstatus_to_exitcode(status) == 0
