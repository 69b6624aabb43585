"""The lock table under many distinct keys: each store locks and releases --keys distinct keys
(one thread, no `locks prune`) while another process locks and releases one key of its own,
and prints the table's rows and size, the calls' latencies and the other process's cycles'.

    .venv/bin/python -m bench.bench_table [--keys 20000] [--stores postgres,mariadb,sqlite]
                                          [--vacuum-every N]

--vacuum-every N runs VACUUM on PostgreSQL's lock table every N keys, as autovacuum would on a
server that has it on (this machine's has it off).

It uses a database of its own (keel_lock_bench_table) and empties its lock table first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from .common import percentile, print_table, setup_django

STORES = ["postgres", "mariadb", "sqlite"]


def _is_postgres(store: Any) -> bool:
    return bool(store.dialect.vendor == "postgresql")


def _size(store: Any) -> str:
    """The lock table's size on disk, where the database says so exactly (PostgreSQL)."""
    if not _is_postgres(store):
        return "-"
    rows, _ = store.execute([("SELECT pg_total_relation_size('django_keel_lock_lock')", ())])
    return f"{int(rows[0][0]) / 1e6:.2f} MB"


def _other(alias: str, pipe: Connection) -> None:
    """Lock and release one key until told to stop; send the cycles' latencies (ms) and how
    many failed."""
    from django_keel_lock import LockStoreUnavailable, get_lock_store

    store = get_lock_store(alias)
    key, owner = f"bench:table:other:{uuid.uuid4().hex}", uuid.uuid4().hex
    samples: list[float] = []
    pipe.send("ready")
    failed = 0
    while not pipe.poll():
        t0 = time.perf_counter()
        try:  # SQLite: a writer may wait out its busy timeout behind the other
            store.acquire(key, owner, "other", 30)
            store.release(key, owner)
        except LockStoreUnavailable:
            failed += 1
        samples.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.002)
    pipe.send((samples, failed))


def run(alias: str, keys: int, vacuum_every: int = 0) -> list[object]:
    from django_keel_lock import get_lock_store
    from django_keel_lock.models import Lock, Permit

    store: Any = get_lock_store(alias)
    database = store.database
    Lock.objects.using(database).all().delete()
    Permit.objects.using(database).all().delete()
    if _is_postgres(store):
        store.execute([("VACUUM FULL django_keel_lock_lock", ())])
    from django.db import connections

    connections.close_all()  # not into the fork
    parent, child = multiprocessing.Pipe()
    other = multiprocessing.get_context("fork").Process(target=_other, args=(alias, child))
    other.start()
    assert parent.recv() == "ready"
    prefix = f"bench:table:{uuid.uuid4().hex[:8]}:"
    owner = uuid.uuid4().hex
    acquires: list[float] = []
    releases: list[float] = []
    most = 0
    clock = time.perf_counter
    started = clock()
    for n in range(keys):
        key = f"{prefix}{n}"
        t0 = clock()
        assert store.acquire(key, owner, "bench", 30).acquired
        t1 = clock()
        assert store.release(key, owner)
        t2 = clock()
        acquires.append((t1 - t0) * 1000)
        releases.append((t2 - t1) * 1000)
        if n % 1000 == 999:
            most = max(most, Lock.objects.using(database).count())
        if vacuum_every and n % vacuum_every == vacuum_every - 1 and _is_postgres(store):
            store.execute([("VACUUM django_keel_lock_lock", ())])
    elapsed = clock() - started
    parent.send("stop")
    others, failed = parent.recv()
    other.join()
    left = Lock.objects.using(database).count()
    return [
        alias,
        keys,
        max(most, left),
        left,
        _size(store),
        percentile(acquires, 99),
        max(acquires),
        max(releases),
        keys / elapsed,
        percentile(others, 99),
        max(others),
        failed,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--vacuum-every", type=int, default=0, help="keys (PostgreSQL)")
    args = parser.parse_args()
    os.environ.setdefault("KEEL_BENCH_DB", "keel_lock_bench_table")
    setup_django()
    from django.conf import settings

    available = {"sqlite"} | set(settings.DATABASES)
    aliases = [s for s in args.stores.split(",") if s in available]
    print(f"django-keel-lock table benchmark, pid {os.getpid()}, {args.keys:,} distinct keys")
    rows = [run(alias, args.keys, args.vacuum_every) for alias in aliases]
    print_table(
        [
            "store",
            "keys",
            "most rows",
            "rows left",
            "table size",
            "acquire p99 ms",
            "acquire max ms",
            "release max ms",
            "cycles/s",
            "other's cycle p99 ms",
            "other's cycle max ms",
            "other's failed",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
