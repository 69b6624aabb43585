"""Shared benchmark plumbing: Django set-up on real databases, timing and table printing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence


def setup_django(settings_module: str = "bench.settings") -> None:
    """Create the bench databases if missing, then django.setup() and migrate them."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", settings_module)
    import django
    from django.conf import settings

    _create_databases(settings.DATABASES, settings.BENCH_DB)
    django.setup()
    from django.core.management import call_command

    for alias in settings.DATABASES:
        call_command("migrate", database=alias, verbosity=0)


def _create_databases(databases: dict[str, dict[str, object]], name: str) -> None:
    pg = databases["postgres"]
    try:
        import psycopg

        with psycopg.connect(
            host=pg["HOST"], port=pg["PORT"], user=pg["USER"], dbname="postgres", autocommit=True
        ) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(f"CREATE DATABASE {name}")
    except Exception as exc:  # a missing server drops that column, it does not stop the bench
        print(f"PostgreSQL unavailable: {exc}")
        del databases["postgres"]
    my = databases["mariadb"]
    try:
        import MySQLdb

        conn = MySQLdb.connect(host=my["HOST"], port=my["PORT"], user=my["USER"], passwd="")
        conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS {name} CHARACTER SET utf8mb4")
        conn.close()
    except Exception as exc:
        print(f"MariaDB unavailable: {exc}")
        del databases["mariadb"]


def rate(cycle: Callable[[], object], seconds: float) -> float:
    """Calls of `cycle` per second over about `seconds` (after a short warm-up)."""
    warm_until = time.perf_counter() + min(0.3, seconds / 5)
    while time.perf_counter() < warm_until:
        cycle()
    count, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(50):
            cycle()
        count += 50
        now = time.perf_counter()
        if now >= deadline:
            return count / (now - start)


def interleaved_rates(
    cycles: dict[str, Callable[[], object]], seconds: float, slices: int = 8
) -> dict[str, float]:
    """Calls per second of each cycle. The machine may be shared (or a VM), so the cycles take
    turns in short slices and each gets the median of its slices: a burst of someone else's
    load, or a slower minute, hits all of them alike instead of one."""
    samples: dict[str, list[float]] = {name: [] for name in cycles}
    for _ in range(slices):
        for name, cycle in cycles.items():
            samples[name].append(rate(cycle, seconds / slices))
    return {name: percentile(values, 50) for name, values in samples.items()}


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table that pastes into Markdown."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(line(row))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value >= 1000:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
