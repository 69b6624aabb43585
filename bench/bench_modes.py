"""Semaphores and shared locks next to the exclusive lock, store by store, in one run:
uncontended acquire+release cycles/s of each mode, and the handoff of a released permit (or
lock) to a waiter blocked in another process.

    .venv/bin/python -m bench.bench_modes [--seconds 2] [--rounds 40] [--stores postgres,redis]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .common import interleaved_rates, percentile, print_table, setup_django

STORES = ["postgres", "postgres-fast", "mariadb", "sqlite", "redis"]
LIMIT = 3
TTL = 30
#: Each mode as the keyword arguments `lock()`/`semaphore()` take, and how it is made.
MODES: dict[str, dict[str, Any]] = {
    "exclusive": {},
    f"semaphore({LIMIT})": {"limit": LIMIT},
    "shared": {"shared": True},
}


def handle(alias: str, key: str, mode: dict[str, Any], limit: int | None = None) -> Any:
    from django_keel_lock import lock, semaphore

    if "limit" in mode:
        return semaphore(key, limit=limit or mode["limit"], ttl=TTL, store=alias)
    return lock(key, ttl=TTL, store=alias, shared=bool(mode.get("shared")))


def _cycle(alias: str, mode: dict[str, Any]) -> Callable[[], None]:
    held = handle(alias, f"bench:modes:{uuid.uuid4().hex}", mode)

    def cycle() -> None:
        assert held.acquire()
        held.release()

    return cycle


def _waiter(alias: str, key: str, mode: dict[str, Any], pipe: Connection) -> None:
    while pipe.recv() == "go":
        waiting = handle(alias, key, mode, limit=1)
        assert waiting.acquire(timeout=10), "the waiter never got in"
        returned = time.monotonic()
        waiting.release()
        pipe.send(returned)


def handoff(alias: str, mode: dict[str, Any], rounds: int) -> list[float]:
    """Milliseconds from a release to the acquire of a waiter (in `mode`) in another process
    returning. The holder: a semaphore of limit 1, so the one permit released is the one the
    waiter needs; for a shared waiter, a writer (readers would not make it wait)."""
    key = f"bench:modes-handoff:{uuid.uuid4().hex}"
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_waiter, args=(alias, key, mode, child), daemon=True
    )
    proc.start()
    samples = []
    try:
        for _ in range(rounds):
            holder = handle(alias, key, {"limit": 1} if "limit" in mode else {})
            assert holder.acquire(timeout=10)
            parent.send("go")
            time.sleep(0.03)  # let the waiter block
            released = time.monotonic()
            holder.release()
            samples.append((parent.recv() - released) * 1000)
    finally:
        parent.send("stop")
        proc.join(5)
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per cycles/s figure")
    parser.add_argument("--rounds", type=int, default=40, help="handoffs per store and mode")
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args(argv)
    setup_django()
    from django.conf import settings

    stores = [s for s in args.stores.split(",") if s in settings.KEEL_LOCK_STORES]
    print(f"{os.cpu_count()} CPUs; cycles over {args.seconds:g}s per store and mode")
    rows: list[list[object]] = []
    for alias in stores:
        rates = interleaved_rates(
            {name: _cycle(alias, mode) for name, mode in MODES.items()}, args.seconds * 3
        )
        for name, mode in MODES.items():
            samples = handoff(alias, mode, args.rounds)
            ratio = rates[name] / rates["exclusive"]
            p50, p90 = percentile(samples, 50), percentile(samples, 90)
            rows.append([alias, name, rates[name], f"{ratio:.2f}", p50, p90])
    print_table(
        ["store", "mode", "cycles/s", "x exclusive", "handoff p50 ms", "handoff p90 ms"], rows
    )


if __name__ == "__main__":
    main()
