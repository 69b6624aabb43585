"""Database store benchmark: uncontended cycles/s and cross-process handoff latency, next to
a PostgreSQL advisory lock, the common 3-statement recipe on the same server, and
django-mysql's Lock (GET_LOCK) on MariaDB; for PostgreSQL and MariaDB also the floor of any
handoff through a table (two commits one after the other, nothing woken), and for SQLite the
kernel's fcntl.flock. Every contender is measured in short alternating rounds of one run; the
ratios are the median of the round-by-round ratios, with their least and most.

    .venv/bin/python -m bench.bench_db [--rounds 20] [--seconds 0.1] [--handoffs 2]
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from .common import (
    COMPARED,
    Contender,
    HandoffRig,
    Pair,
    compared_rows,
    measure,
    print_table,
    round_options,
    setup_django,
)

__all__ = ["Pair", "django_mysql_lock", "pg_raw"]  # bench_contention's

STORES = ["sqlite", "postgres", "postgres-fast", "mariadb"]


def store_pair(alias: str, key: str) -> Pair:
    from django_keel_lock import lock

    handle = lock(key, ttl=30, store=alias)

    def take() -> None:
        assert handle.acquire(timeout=10), "waiter never got the lock"

    return take, handle.release


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


def django_mysql_pair(name: str) -> Pair:
    held = django_mysql_lock(name)
    return held.acquire, held.release


def commits_floor(alias: str) -> Callable[[int], list[float]]:
    """Times n rounds of two autocommit UPDATEs of one row, one after the other, each after
    the same pause as a handoff's: the least a handoff through a table can cost where both
    the release and the take must commit (no wake-up, no second process)."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS bench_commit_floor (id int PRIMARY KEY, n int)")
        cursor.execute("DELETE FROM bench_commit_floor")
        cursor.execute("INSERT INTO bench_commit_floor VALUES (1, 0)")

    def run(rounds: int) -> list[float]:
        samples = []
        with connections[alias].cursor() as cursor:
            for _ in range(rounds):
                time.sleep(HandoffRig.SETTLE)
                started = time.monotonic()
                cursor.execute("UPDATE bench_commit_floor SET n = n + 1 WHERE id = 1")
                cursor.execute("UPDATE bench_commit_floor SET n = n + 1 WHERE id = 1")
                samples.append((time.monotonic() - started) * 1000)
        return samples

    return run


def advisory_pair() -> Pair:
    conn = pg_raw()
    return (
        lambda: conn.execute("SELECT pg_advisory_lock(77)"),
        lambda: conn.execute("SELECT pg_advisory_unlock(77)"),
    )


def flock_pair(path: str) -> Pair:
    """The kernel's own blocking lock between two processes of one machine (fcntl.flock), the
    floor for SQLite's handoff; each process opens the file itself (flock locks belong to an
    open file)."""
    import fcntl

    file = open(path, "a")  # noqa: SIM115 - held for the process's life
    return (lambda: fcntl.flock(file, fcntl.LOCK_EX), lambda: fcntl.flock(file, fcntl.LOCK_UN))


def _rig(make: Callable[[], Pair], thread: bool = False) -> Callable[[int], list[float]]:
    return HandoffRig(make, thread=thread).run


def contenders(aliases: list[str]) -> list[Contender]:
    """Our stores and, for each server, the locks we stand beside (each names the row of ours
    it is compared with)."""
    from django.conf import settings

    def ours(alias: str) -> Contender:
        key = f"bench:handoff:{uuid.uuid4().hex}"
        thread = alias == "memory"  # one process's locks
        rig = _rig(lambda: store_pair(alias, key), thread)
        return Contender(f"keel-lock {alias}", store_cycle(alias), rig)

    rows = [ours(alias) for alias in aliases]
    if "postgres" in settings.DATABASES:
        fast = "keel-lock postgres-fast" if "postgres-fast" in aliases else None
        durable = "keel-lock postgres" if "postgres" in aliases else None
        rows.append(Contender("pg advisory lock", advisory_cycle(), _rig(advisory_pair), fast))
        rows.append(Contender("3-statement recipe (pg)", recipe_cycle(), ours=durable))
    if "mariadb" in aliases:
        name = f"bench:handoff:{uuid.uuid4().hex}"
        rig = _rig(lambda: django_mysql_pair(name))
        rows.append(Contender("django-mysql Lock", django_mysql_cycle(), rig, "keel-lock mariadb"))
    for alias in ("postgres", "mariadb"):
        if alias in aliases:
            floor = commits_floor(alias)
            rows.append(
                Contender(f"2 commits, no wake ({alias})", None, floor, f"keel-lock {alias}")
            )
    if "sqlite" in aliases:
        path = f"{settings.DATABASES['default']['NAME']}.{os.getpid()}.flock"
        open(path, "a").close()
        atexit.register(os.unlink, path)
        rig = _rig(lambda: flock_pair(path))
        rows.append(Contender("fcntl.flock (kernel)", None, rig, "keel-lock sqlite"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = round_options(__doc__)
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args(argv)
    setup_django()
    from django.conf import settings

    available = {"memory", "sqlite"} | set(settings.DATABASES) | {"postgres-fast"}
    if "postgres" not in settings.DATABASES:
        available.discard("postgres-fast")
    aliases = [s for s in args.stores.split(",") if s in available]
    print(
        f"django-keel-lock database benchmark, {os.cpu_count()} CPUs; {args.rounds} rounds of "
        f"{args.seconds:g}s per cycles/s and of {args.handoffs} handoffs per contender"
    )
    rows = contenders(aliases)
    results = measure(rows, args.rounds, args.seconds, args.handoffs)
    print_table(COMPARED, compared_rows(rows, results))


if __name__ == "__main__":
    main()
