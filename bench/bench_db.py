"""Database (and memory) store benchmark: uncontended cycles/s and cross-process handoff latency,
next to a PostgreSQL advisory lock, the common 3-statement recipe on the same server, and
django-mysql's Lock (GET_LOCK) on MariaDB. For PostgreSQL and MariaDB also the floor of any
handoff through a table: two commits one after the other, nothing woken.

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


#: How one process takes and gives back the lock a handoff passes around.
Pair = tuple[Callable[[], object], Callable[[], object]]


def _pair_waiter(make: Callable[[], Pair], pipe: Connection) -> None:
    take, give = make()
    while pipe.recv() == "go":
        take()
        returned = time.monotonic()
        give()
        pipe.send(returned)


def handoff(make: Callable[[], Pair], rounds: int, thread: bool = False) -> list[float]:
    """Milliseconds from the holder's release to a waiter's acquire returning, the waiter in
    another process (a thread if `thread`); each side takes and gives with its own make()."""
    parent, child = multiprocessing.Pipe()
    if thread:
        import threading

        threading.Thread(target=_pair_waiter, args=(make, child), daemon=True).start()
    else:
        multiprocessing.get_context("fork").Process(
            target=_pair_waiter, args=(make, child), daemon=True
        ).start()
    take, give = make()
    samples = []
    for _ in range(rounds):
        take()
        parent.send("go")
        time.sleep(0.03)  # let the waiter start waiting
        released = time.monotonic()
        give()
        samples.append((parent.recv() - released) * 1000)
    parent.send("stop")
    return samples


def handoff_store(alias: str, rounds: int) -> list[float]:
    key = f"bench:handoff:{uuid.uuid4().hex}"

    def make() -> Pair:
        from django_keel_lock import lock

        handle = lock(key, ttl=30, store=alias)

        def take() -> None:
            assert handle.acquire(timeout=10), "waiter never got the lock"

        return take, handle.release

    return handoff(make, rounds, thread=alias == "memory")  # memory: one process


def store_cycle(alias: str) -> Callable[[], None]:
    from django_keel_lock import lock

    handle = lock(f"bench:cycle:{uuid.uuid4().hex}", ttl=30, store=alias)

    def cycle() -> None:
        handle.acquire()
        handle.release()

    return cycle


def pg_raw() -> Any:
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
    conn = pg_raw()
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
    conn = pg_raw()
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


def advisory_handoff(rounds: int) -> list[float]:
    def make() -> Pair:
        conn = pg_raw()
        return (
            lambda: conn.execute("SELECT pg_advisory_lock(77)"),
            lambda: conn.execute("SELECT pg_advisory_unlock(77)"),
        )

    return handoff(make, rounds)


#: Django connections set aside unclosed: a forked child's are its parent's sockets, and
#: closing one (as garbage collection would) would end the parent's session.
_SET_ASIDE: list[Any] = []


def django_mysql_lock(name: str) -> Any:
    """django-mysql's Lock (GET_LOCK) on the MariaDB database, on a Django connection of this
    process's own."""
    from django.db import connections
    from django_mysql.locks import Lock

    _SET_ASIDE.append(connections["mariadb"])
    del connections["mariadb"]
    return Lock(name, acquire_timeout=10, using="mariadb")


def django_mysql_cycle() -> Callable[[], None]:
    held = django_mysql_lock(f"bench:cycle:{uuid.uuid4().hex}")

    def cycle() -> None:
        held.acquire()
        held.release()

    return cycle


def django_mysql_handoff(rounds: int) -> list[float]:
    name = f"bench:handoff:{uuid.uuid4().hex}"

    def make() -> Pair:
        held = django_mysql_lock(name)
        return held.acquire, held.release

    return handoff(make, rounds)


def commits_floor(alias: str, rounds: int) -> list[float]:
    """Milliseconds of two autocommit UPDATEs of one row, one after the other, each round
    after the same 30 ms pause as a handoff's: the least a handoff through a table can cost
    where both the release and the take must commit (no wake-up, no second process)."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS bench_commit_floor (id int PRIMARY KEY, n int)")
        cursor.execute("DELETE FROM bench_commit_floor")
        cursor.execute("INSERT INTO bench_commit_floor VALUES (1, 0)")
        samples = []
        for _ in range(rounds):
            time.sleep(0.03)
            started = time.monotonic()
            cursor.execute("UPDATE bench_commit_floor SET n = n + 1 WHERE id = 1")
            cursor.execute("UPDATE bench_commit_floor SET n = n + 1 WHERE id = 1")
            samples.append((time.monotonic() - started) * 1000)
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
    if "mariadb" in aliases:
        contenders["django-mysql"] = django_mysql_cycle()
    # Cycles/s of everything in turns (ratios come from the same minutes), then handoffs.
    results = interleaved_rates(contenders, args.seconds * len(contenders))
    rows: list[list[object]] = []
    p50: dict[str, float] = {}

    def row(name: str, contender: str, samples: list[float]) -> None:
        p50[contender] = percentile(samples, 50)
        rows.append([name, results[contender], p50[contender], percentile(samples, 90)])

    for alias in aliases:
        row(f"keel-lock {alias}", alias, handoff_store(alias, args.rounds))
    if "advisory" in results:
        row("pg advisory lock", "advisory", advisory_handoff(args.rounds))
        rows.append(["3-statement recipe (pg)", results["recipe"], "-", "-"])
    if "django-mysql" in results:
        row("django-mysql Lock", "django-mysql", django_mysql_handoff(args.rounds))
    for alias in ("postgres", "mariadb"):
        if alias in aliases:
            floor = commits_floor(alias, args.rounds)
            p50[f"floor-{alias}"] = percentile(floor, 50)
            rows.append(
                [f"2 commits, no wake ({alias})", "-", p50[f"floor-{alias}"], percentile(floor, 90)]
            )
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
    if "django-mysql" in p50 and "mariadb" in p50:
        print(
            "mariadb handoff p50 / django-mysql Lock's: "
            f"{p50['mariadb'] / p50['django-mysql']:.2f}x (target <= 2x, and <= 5 ms); "
            f"2 commits alone: {p50['floor-mariadb'] / p50['django-mysql']:.2f}x"
        )
    if "advisory" in results and "postgres-fast" in results:
        print(
            f"postgres-fast (DURABLE=False) / advisory lock: "
            f"{results['postgres-fast'] / results['advisory']:.2f}x (target >= 0.8x)"
        )


if __name__ == "__main__":
    main()
