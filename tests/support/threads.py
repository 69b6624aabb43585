"""A store call (or a wait for a key's release) in a thread of its own, for tests that hold one
call at a point while another runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django_keel_lock.stores import DatabaseLockStore


def call_in_thread(
    store: DatabaseLockStore, call: Callable[[], Any]
) -> tuple[threading.Thread, list[Any]]:
    """Start `call()` in a new thread; its result or exception lands in the list. The thread
    drops its own connection to `store` when done."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)
        finally:
            store._threads.drop()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def waiting_in_thread(store: Any, key: str, seconds: float) -> tuple[threading.Thread, list[float]]:
    """Start a thread that waits `seconds` for a release of `key` in `store` (its `Waiter`);
    how long it waited lands in the list."""
    waited: list[float] = []

    def wait() -> None:
        with store.watch(key) as waiter:
            began = time.monotonic()
            waiter.wait(seconds)
            waited.append(time.monotonic() - began)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, waited
