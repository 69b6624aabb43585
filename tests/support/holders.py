"""Hold a lock "somewhere else" for surface tests: another process when the store is shared
between processes, another handle in this process for the memory store; or keep trying to take
one that a surface holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from django_keel_lock import get_lock_store, lock

from . import ROOT

PER_PROCESS_STORES = {"memory"}


def held_before_children(alias: str, key: str) -> Any:
    """A handle holding `key` in `alias`, with this process's connections to the store
    closed, so that child processes started next do not share them."""
    handle = lock(key, ttl=30, store=alias)
    assert handle.acquire()
    get_lock_store(alias).close()
    return handle


def child_env() -> dict[str, str]:
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}


@contextmanager
def held_elsewhere(store: str, key: str, ttl: float = 30) -> Iterator[dict[str, Any]]:
    """Hold `key` in `store` from another process (another handle for a per-process store)
    until the block ends, when the holder stops and its lock is freed; yields what the holder
    reported (fence, remaining, ...)."""
    if store in PER_PROCESS_STORES:
        handle = lock(key, ttl=ttl, store=store, holder="elsewhere:1")
        assert handle.acquire()
        try:
            yield {"acquired": True, "fence": handle.fence, "remaining": handle.remaining_time()}
        finally:
            handle.release()
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.child", "acquire", "--store", store, "--key", key,
         "--ttl", str(ttl), "--hold", str(ttl)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        assert report["acquired"], report
        yield report
    finally:
        proc.kill()
        proc.wait()
        # In a thread: this may run inside an event loop (async tests), where DB calls refuse.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(get_lock_store(store).force_release, key).result()


MANAGE = (
    "import sys; from tests.support.child import setup_django; setup_django(); "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)


def manage(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """`manage.py <args>` in a fresh process on the test databases."""
    return subprocess.run(
        [sys.executable, "-c", MANAGE, *args],
        cwd=ROOT, env=child_env(), input=input, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def takeovers(store: str, key: str, seconds: float, *, until_taken: bool = False) -> list[float]:
    """Try to take `key` from another handle every 50 ms for `seconds` (what a long function
    under a lock does here); the times (seconds in) at which it got it, each released at once.
    `until_taken`: stop at the first."""
    started = time.monotonic()
    taken: list[float] = []
    while (elapsed := time.monotonic() - started) < seconds:
        outsider = lock(key, ttl=60, store=store, holder="outsider:1")
        if outsider.acquire():
            taken.append(elapsed)
            outsider.release()
            if until_taken:
                break
        time.sleep(0.05)
    return taken
