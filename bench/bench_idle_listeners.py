"""A contended PostgreSQL release (it NOTIFYs) beside processes that waited once and now idle.

PostgreSQL signals every connection of the database that listens to anything at each NOTIFY,
so an idle process's listener that kept listening would make every contended release dearer;
ours listens to nothing a second after its process's last waiter stops. Each idle process
here waits once for a key of its own (its listener connects and listens), then sleeps past
that second; the release timed is one that found its flag raised by a refused attempt.

    .venv/bin/python -m bench.bench_idle_listeners [--idle 0,10,30] [--releases 300]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid
from typing import Any

from .common import setup_django

STORE = "postgres-fast"


def _idle(key: str, ready: Any) -> None:
    from django_keel_lock import lock

    handle = lock(key, ttl=30, store=STORE)
    if handle.acquire(timeout=10):  # waits for the parent's hold: its listener listens
        handle.release()
    ready.set()
    time.sleep(3600)


def _start_idle(count: int) -> list[Any]:
    """`count` processes that each waited once (handed the lock by this one), then idle."""
    from django_keel_lock import lock

    context = multiprocessing.get_context("fork")
    processes = []
    for _ in range(count):
        key = f"bench:idle:{uuid.uuid4().hex}"
        held = lock(key, ttl=30, store=STORE)
        assert held.acquire()
        ready = context.Event()
        process = context.Process(target=_idle, args=(key, ready), daemon=True)
        process.start()
        time.sleep(0.3)  # it waits
        held.release()
        assert ready.wait(15), "an idle process never got its lock"
        processes.append(process)
    return processes


def contended_releases(releases: int) -> list[float]:
    """Microseconds of each of `releases` releases that NOTIFY (a refused attempt raised the
    key's flag), on keys of their own."""
    from django_keel_lock.registry import get_lock_store

    store = get_lock_store(STORE)
    samples = []
    for n in range(releases):
        key = f"bench:idle-release:{uuid.uuid4().hex}:{n}"
        assert store.acquire(key, "holder", "h", 30).acquired
        assert not store.acquire(key, "other", "h", 30).acquired  # raises the flag
        time.sleep(0.002)
        began = time.perf_counter()
        assert store.release(key, "holder")
        samples.append((time.perf_counter() - began) * 1e6)
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--idle", default="0,10,30", help="idle processes, one row each")
    parser.add_argument("--releases", type=int, default=300, help="releases timed per row")
    args = parser.parse_args(argv)
    setup_django()
    print("| idle processes | contended release p50 µs | p90 µs |")
    print("| --- | --- | --- |")
    processes: list[Any] = []
    try:
        for count in sorted(int(n) for n in args.idle.split(",")):
            processes += _start_idle(count - len(processes))
            time.sleep(2)  # past their listeners' linger (1 s)
            samples = contended_releases(args.releases)
            p90 = statistics.quantiles(samples, n=10)[-1]
            print(f"| {count} | {statistics.median(samples):.0f} | {p90:.0f} |")
    finally:
        for process in processes:
            process.kill()


if __name__ == "__main__":
    main()
