"""Many processes on one key: does throughput hold up, and does every process get its turn?

For each store and each process count (1, 2, 4, 8, 16, 32), that many processes loop for
`--seconds` on one key: acquire (waiting up to 10 s), hold for `--hold` ms, release, then
`--gap` ms before asking again. Printed per store: acquisitions/s of all of them, the
ratio to 2 processes, p50 / p99 of the wait for the lock, and the least-served process's
share against the mean. Next to them, for scale, the servers' own queues with nothing of
ours in the way: PostgreSQL's blocking `pg_advisory_lock` (`advisory`), MariaDB's
`GET_LOCK` through django-mysql's `Lock` (`django-mysql`) and a Redis list holding one
token (`BLPOP` takes it, `LPUSH` gives it back: `blpop`), each taken and given by the same
loop, so what they lose from 2 to 32 processes is what the machine loses.

    .venv/bin/python -m bench.bench_contention
        [--stores postgres,redis,mariadb,advisory,django-mysql,blpop]
        [--counts 1,2,4,8,16,32] [--seconds 4] [--hold 0] [--gap 0]

Targets (issue 18): acquisitions/s at 32 processes >= 0.7x at 2; least share >= 0.5x the
mean at every count.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import uuid
import zlib
from multiprocessing.connection import Connection
from typing import Any

from .bench_db import Pair, django_mysql_lock, pg_raw
from .common import percentile, print_table, setup_django
from .settings import REDIS_URL

STORES = ["postgres", "redis", "mariadb", "advisory", "django-mysql", "blpop"]
COUNTS = [1, 2, 4, 8, 16, 32]
#: Waits kept per process (every n-th, evenly): enough for a p99, little to send back.
SAMPLES = 2_000


def _redis() -> Any:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.ping()  # connected before the start, not in the timed part
    return client


def _pair(alias: str, key: str) -> Pair:
    """How a process takes (waiting up to 10 s) and gives back the lock on `key`, connected."""
    if alias == "advisory":
        conn = pg_raw()
        lock_id = zlib.crc32(key.encode())

        def take_advisory() -> bool:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_id,))  # waits as long as it takes
            return True

        return take_advisory, lambda: conn.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
    if alias == "django-mysql":
        held = django_mysql_lock(key)

        def take_named() -> bool:
            held.acquire()  # raises if not within its acquire_timeout (10 s)
            return True

        return take_named, held.release
    if alias == "blpop":
        client = _redis()
        return (
            lambda: client.blpop([key], timeout=10) is not None,
            lambda: client.lpush(key, "token"),
        )
    from django_keel_lock import lock

    handle = lock(key, ttl=30, store=alias)
    handle.is_locked()  # connect before the start, not in the timed part
    return (lambda: handle.acquire(timeout=10)), handle.release


def _worker(
    alias: str, key: str, start_at: float, seconds: float, hold: float, gap: float, pipe: Connection
) -> None:
    take, give = _pair(alias, key)
    while time.monotonic() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    count, waits = 0, []
    while True:
        asked = time.monotonic()
        if asked >= end:
            break
        if take():
            waits.append(time.monotonic() - asked)
            count += 1
            if hold:
                time.sleep(hold)
            give()
        if gap:
            time.sleep(gap)
    step = max(1, len(waits) // SAMPLES)
    pipe.send((count, waits[::step]))


def contend(alias: str, processes: int, seconds: float, hold: float, gap: float) -> list[object]:
    """One row: `processes` processes on one key of `alias` for `seconds`."""
    from django.db import connections

    connections.close_all()  # the children must not share the parent's connections
    key = f"bench:contention:{uuid.uuid4().hex}"
    if alias == "blpop":
        client = _redis()
        client.lpush(key, "token")  # the one token, gone a minute after the run
        client.expire(key, int(seconds) + 60)
        client.close()
    start_at = time.monotonic() + 1.0 + processes * 0.05
    context = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for _ in range(processes):
        parent, child = context.Pipe()
        proc = context.Process(
            target=_worker, args=(alias, key, start_at, seconds, hold, gap, child), daemon=True
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(10)
    counts = [count for count, _ in results]
    waits = [wait * 1000 for _, some in results for wait in some]
    mean = sum(counts) / len(counts)
    return [
        processes,
        round(sum(counts) / seconds),
        percentile(waits, 50) if waits else "-",
        percentile(waits, 99) if waits else "-",
        f"{min(counts) / mean:.2f}" if mean else "-",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    parser.add_argument("--seconds", type=float, default=4.0, help="per process count")
    parser.add_argument("--hold", type=float, default=0.0, help="ms each acquisition is held")
    parser.add_argument("--gap", type=float, default=0.0, help="ms between release and asking")
    args = parser.parse_args(argv)
    setup_django()
    counts = [int(each) for each in args.counts.split(",")]
    print(
        f"{os.cpu_count()} CPUs; {args.seconds:g}s per process count, hold {args.hold:g} ms, "
        f"gap {args.gap:g} ms"
    )
    for alias in args.stores.split(","):
        rows = [contend(alias, n, args.seconds, args.hold / 1000, args.gap / 1000) for n in counts]
        at_two = next((row[1] for row in rows if row[0] == 2), None)
        for row in rows:
            row.insert(2, f"{row[1] / at_two:.2f}" if at_two else "-")  # type: ignore[operator]
        print(f"\n{alias}")
        print_table(
            ["processes", "acquisitions/s", "x at 2", "wait p50 ms", "wait p99 ms", "least share"],
            rows,
        )


if __name__ == "__main__":
    main()
