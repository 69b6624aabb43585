"""Database (and memory) store benchmark: uncontended cycles/s and cross-process handoff latency,
next to a PostgreSQL advisory lock and the common 3-statement recipe on the same server.

    .venv/bin/python -m bench.bench_db [--seconds 3] [--rounds 40]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from typing import Any

from .common import interleaved_rates, percentile, print_table, setup_django

STORES = ["memory", "sqlite", "postgres", "postgres-fast", "mariadb"]


def _handoff_waiter(alias: str, key: str, pipe: Connection) -> None:
    from django_keel_lock import lock

    while pipe.recv() == "go":
        handle = lock(key, ttl=30, store=alias)
        assert handle.acquire(timeout=10), "waiter never got the lock"
        returned = time.monotonic()
        handle.release()
        pipe.send(returned)


def handoff_store(alias: str, rounds: int) -> list[float]:
    """Milliseconds from the holder's release to a waiter's acquire returning (other process)."""
    from django_keel_lock import lock

    key = f"bench:handoff:{uuid.uuid4().hex}"
    if alias == "memory":  # one process: the waiter is a thread
        import threading

        parent, child = multiprocessing.Pipe()
        thread = threading.Thread(target=_handoff_waiter, args=(alias, key, child), daemon=True)
        thread.start()
    else:
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=_handoff_waiter, args=(alias, key, child), daemon=True
        )
        proc.start()
    holder = lock(key, ttl=30, store=alias)
    samples = []
    for _ in range(rounds):
        assert holder.acquire(timeout=10)
        parent.send("go")
        time.sleep(0.03)  # let the waiter start waiting
        released = time.monotonic()
        holder.release()
        samples.append((parent.recv() - released) * 1000)
    parent.send("stop")
    return samples


def store_cycle(alias: str) -> Callable[[], None]:
    from django_keel_lock import lock

    handle = lock(f"bench:cycle:{uuid.uuid4().hex}", ttl=30, store=alias)

    def cycle() -> None:
        handle.acquire()
        handle.release()

    return cycle


def _pg_raw() -> Any:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["postgres"]
    return psycopg.connect(
        host=db["HOST"],
        port=db["PORT"],
        user=db["USER"],
        dbname=db["NAME"],
        autocommit=True,
        cursor_factory=psycopg.ClientCursor,  # the same client-side binding Django's wrapper uses
    )


def advisory_cycle() -> Callable[[], None]:
    conn = _pg_raw()
    cursor = conn.cursor()
    lock_id = 424242

    def cycle() -> None:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", (lock_id,))
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
        cursor.fetchone()

    return cycle


def recipe_cycle() -> Callable[[], None]:
    """DELETE expired, INSERT, DELETE to release: 3 statements, the app server's clock."""
    conn = _pg_raw()
    conn.execute(
        "CREATE TABLE IF NOT EXISTS bench_recipe_lock "
        "(key text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL)"
    )
    cursor = conn.cursor()
    key = f"bench:recipe:{uuid.uuid4().hex}"

    def cycle() -> None:
        owner = uuid.uuid4().hex
        now = datetime.now(UTC)
        cursor.execute(
            "DELETE FROM bench_recipe_lock WHERE key = %s AND expires_at < %s", (key, now)
        )
        cursor.execute(
            "INSERT INTO bench_recipe_lock VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            (key, owner, now + timedelta(seconds=30)),
        )
        cursor.execute("DELETE FROM bench_recipe_lock WHERE key = %s AND owner = %s", (key, owner))

    return cycle


def _advisory_waiter(pipe: Connection) -> None:
    conn = _pg_raw()
    while pipe.recv() == "go":
        conn.execute("SELECT pg_advisory_lock(77)")
        returned = time.monotonic()
        conn.execute("SELECT pg_advisory_unlock(77)")
        pipe.send(returned)


def advisory_handoff(rounds: int) -> list[float]:
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_advisory_waiter, args=(child,))
    proc.daemon = True
    proc.start()
    conn = _pg_raw()
    samples = []
    for _ in range(rounds):
        conn.execute("SELECT pg_advisory_lock(77)")
        parent.send("go")
        time.sleep(0.03)
        released = time.monotonic()
        conn.execute("SELECT pg_advisory_unlock(77)")
        samples.append((parent.recv() - released) * 1000)
    parent.send("stop")
    return samples


def _flock_waiter(path: str, pipe: Connection) -> None:
    import fcntl

    with open(path, "a") as file:  # its own open file: flock locks belong to one
        while pipe.recv() == "go":
            fcntl.flock(file, fcntl.LOCK_EX)
            returned = time.monotonic()
            fcntl.flock(file, fcntl.LOCK_UN)
            pipe.send(returned)


def flock_handoff(rounds: int) -> list[float]:
    """The kernel's own blocking handoff between two processes of one machine (fcntl.flock),
    the floor for SQLite's."""
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"keel-lock-bench-{os.getpid()}.flock")
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_flock_waiter, args=(path, child))
    proc.daemon = True
    proc.start()
    samples = []
    with open(path, "a") as file:
        for _ in range(rounds):
            fcntl.flock(file, fcntl.LOCK_EX)
            parent.send("go")
            time.sleep(0.03)
            released = time.monotonic()
            fcntl.flock(file, fcntl.LOCK_UN)
            samples.append((parent.recv() - released) * 1000)
    parent.send("stop")
    os.unlink(path)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="per cycles/s measurement")
    parser.add_argument("--rounds", type=int, default=40, help="handoffs per store")
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args()
    setup_django()
    from django.conf import settings

    available = {"memory", "sqlite"} | set(settings.DATABASES) | {"postgres-fast"}
    if "postgres" not in settings.DATABASES:
        available.discard("postgres-fast")
    print(f"django-keel-lock database benchmark, pid {os.getpid()}, {args.seconds:g}s per rate")
    aliases = [s for s in args.stores.split(",") if s in available]
    contenders: dict[str, Callable[[], None]] = {alias: store_cycle(alias) for alias in aliases}
    if "postgres" in settings.DATABASES:
        contenders["advisory"] = advisory_cycle()
        contenders["recipe"] = recipe_cycle()
    # Cycles/s of everything in turns (ratios come from the same minutes), then handoffs.
    results = interleaved_rates(contenders, args.seconds * len(contenders))
    rows: list[list[object]] = []
    for alias in aliases:
        handoff = handoff_store(alias, args.rounds)
        rows.append(
            [f"keel-lock {alias}", results[alias], percentile(handoff, 50), percentile(handoff, 90)]
        )
    if "advisory" in results:
        handoff = advisory_handoff(args.rounds)
        rows.append(
            [
                "pg advisory lock",
                results["advisory"],
                percentile(handoff, 50),
                percentile(handoff, 90),
            ]
        )
        rows.append(["3-statement recipe (pg)", results["recipe"], "-", "-"])
    if "sqlite" in aliases:
        handoff = flock_handoff(args.rounds)
        rows.append(["fcntl.flock (kernel)", "-", percentile(handoff, 50), percentile(handoff, 90)])
    print_table(["lock", "cycles/s", "handoff p50 ms", "handoff p90 ms"], rows)
    if "recipe" in results and "postgres" in results:
        print(
            "\npostgres (durable) / 3-statement recipe: "
            f"{results['postgres'] / results['recipe']:.2f}x"
            " (target >= 1.2x)"
        )
    if "advisory" in results and "postgres-fast" in results:
        print(
            f"postgres-fast (DURABLE=False) / advisory lock: "
            f"{results['postgres-fast'] / results['advisory']:.2f}x (target >= 0.8x)"
        )


if __name__ == "__main__":
    main()
