"""Shared benchmark plumbing: Django set-up on real databases, contenders measured in
alternating rounds, median ratios with their spread, handoffs, and table printing."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TypeVar

T = TypeVar("T")


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


def drop_databases(name: str) -> None:
    """Drop the bench databases called `name` (PostgreSQL, MariaDB, SQLite's file and its
    wake-up files), once nothing of the bench uses them."""
    import shutil

    from . import settings

    pg, my = settings.DATABASES["postgres"], settings.DATABASES["mariadb"]
    try:
        import psycopg

        with psycopg.connect(
            host=pg["HOST"], port=pg["PORT"], user=pg["USER"], dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    except Exception as exc:
        print(f"PostgreSQL database {name} not dropped: {exc}")
    try:
        import MySQLdb

        conn = MySQLdb.connect(host=my["HOST"], port=my["PORT"], user=my["USER"], passwd="")
        conn.cursor().execute("SET SESSION lock_wait_timeout = 10")
        conn.cursor().execute(f"DROP DATABASE IF EXISTS {name}")
        conn.close()
    except Exception as exc:
        print(f"MariaDB database {name} not dropped: {exc}")
    path = settings.sqlite_path(name)
    for leftover in (path, path + "-wal", path + "-shm"):
        if os.path.exists(leftover):
            os.unlink(leftover)
    shutil.rmtree(path + ".keel-bells", ignore_errors=True)


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


def alternate(measures: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each measure's results over `rounds` short rounds, the contenders taking turns within
    each round (A B C, then C B A, ...: no contender always follows the same one). A slow
    minute of a shared machine then lands on every contender's rounds alike, and the ratio of
    two contenders within one round is what moves least."""
    results: dict[str, list[T]] = {name: [] for name in measures}
    order = list(measures)
    for index in range(rounds):
        for name in order if index % 2 == 0 else reversed(order):
            results[name].append(measures[name]())
    return results


@dataclass(frozen=True)
class Spread:
    """A median, the middle half of the values around it (first to third quartile), the least
    and most of them, and how many are above and below 1 (for ratios)."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    above: int = 0
    below: int = 0

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value, got none")
        above, below = sum(v > 1.0 for v in values), sum(v < 1.0 for v in values)
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0], above, below)
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, q1, q3, min(values), max(values), above, below)

    def __str__(self) -> str:
        middle = f"{_ratio(self.q1)}-{_ratio(self.q3)}"
        return f"{_ratio(self.median)} ({middle}; {_ratio(self.low)}-{_ratio(self.high)})"


def ratio_spread(ours: Sequence[float], theirs: Sequence[float]) -> Spread:
    """The round-by-round ratio ours[i] / theirs[i] (both measured in round i): its median, its
    middle half and its range across rounds."""
    if len(ours) != len(theirs):
        raise ValueError(
            f"ratios need as many rounds on each side, got {len(ours)} and {len(theirs)}"
        )
    return Spread.of([a / b for a, b in zip(ours, theirs, strict=True)])


def sign_test(above: int, below: int) -> float:
    """The two-sided p-value of `above` rounds against `below` if either side were as likely
    (the sign test: a ratio's rounds, ties left out)."""
    rounds = above + below
    if rounds == 0:
        return 1.0
    tail = sum(math.comb(rounds, k) for k in range(max(above, below), rounds + 1))
    return min(1.0, 2 * tail / 2**rounds)


#: How unlikely by chance a B / A verdict must be. A run judges a dozen figures, and a busy
#: machine's rounds are not quite independent: at 0.05 about every second A/A run called one
#: figure changed, at 0.01 one run in two of the last two did; 0.001 calls about one in eighty
#: (in theory), and still tells a change most rounds agree on.
SIGNIFICANCE = 0.001


def verdict(spread: Spread, higher_is_faster: bool) -> str:
    """What a B / A ratio's rounds say: "within noise" unless the rounds fall on one side of
    1.00 more often than chance allows (sign test, p < SIGNIFICANCE; so 10 rounds never tell,
    and 30 tell when 25 or more agree), else whether B is faster or slower (a higher ratio
    is faster for a rate, slower for a time)."""
    if sign_test(spread.above, spread.below) >= SIGNIFICANCE:
        return "within noise"
    return "B faster" if (spread.above > spread.below) == higher_is_faster else "B slower"


def _ratio(value: float) -> str:
    if value < 0.1:
        return f"{value:.3f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def round_options(doc: str | None, rounds: int = 20, handoffs: int = 2) -> argparse.ArgumentParser:
    """A parser for a bench that measures in alternating rounds (its --help: the doc's first
    line). Short rounds keep the figures a ratio divides close in time."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds")
    parser.add_argument("--seconds", type=float, default=0.1, help="per cycles/s round")
    parser.add_argument("--handoffs", type=int, default=handoffs, help="per handoff round")
    return parser


#: How one side of a handoff takes (waiting) and gives back the lock.
Pair = tuple[Callable[[], object], Callable[[], object]]


def _pair_waiter(make: Callable[[], Pair], pipe: Connection) -> None:
    take, give = make()
    while pipe.recv() == "go":
        take()
        returned = time.monotonic()
        give()
        pipe.send(returned)


class HandoffRig:
    """A holder here and a waiter in another process (a thread if `thread`), each with the
    take and give its own call of `make` returns, passing one lock back and forth: `run(n)`
    times n handoffs, in milliseconds from the holder's give to the waiter's take returning."""

    #: Between asking the waiter to take and giving: long enough for it to be waiting.
    SETTLE = 0.03

    def __init__(self, make: Callable[[], Pair], thread: bool = False) -> None:
        self._pipe, child = multiprocessing.Pipe()
        if thread:
            threading.Thread(target=_pair_waiter, args=(make, child), daemon=True).start()
        else:
            process = multiprocessing.get_context("fork").Process(
                target=_pair_waiter, args=(make, child), daemon=True
            )
            process.start()
        self._take, self._give = make()

    def run(self, handoffs: int) -> list[float]:
        samples = []
        for _ in range(handoffs):
            self._take()  # waits while the waiter still holds it from the round before
            self._pipe.send("go")
            time.sleep(self.SETTLE)
            released = time.monotonic()
            self._give()
            samples.append((self._pipe.recv() - released) * 1000)
        return samples

    def stop(self) -> None:
        self._pipe.send("stop")  # the waiter gave the last one back before it answered


@dataclass
class Contender:
    """One lock in a side-by-side table: how to time its uncontended cycle (`cycle`, called
    over and over), how to time n of its handoffs (`handoffs(n)` -> milliseconds each), and
    which keel-lock row it is compared with (`ours`; none for our own rows)."""

    name: str
    cycle: Callable[[], object] | None = None
    handoffs: Callable[[int], list[float]] | None = None
    ours: str | None = None


@dataclass
class Measured:
    """A contender's rounds: cycles/s of each round, and the handoffs (ms) of each round."""

    rates: list[float]
    handoffs: list[list[float]]


def measure(
    contenders: Sequence[Contender], rounds: int, seconds: float, handoffs: int
) -> dict[str, Measured]:
    """Every contender's cycles/s in `rounds` alternating rounds of about `seconds` each, then
    its handoffs in `rounds` alternating rounds of `handoffs` each. Within a round each peer
    runs right after (or, every other round, right before) the row of ours it faces, so the
    two figures of a ratio are measured next to each other."""
    contenders = paired(contenders)
    rates = alternate({c.name: _rate_of(c.cycle, seconds) for c in contenders if c.cycle}, rounds)
    samples = alternate(
        {c.name: _handoffs_of(c.handoffs, handoffs) for c in contenders if c.handoffs}, rounds
    )
    return {c.name: Measured(rates.get(c.name, []), samples.get(c.name, [])) for c in contenders}


def paired(contenders: Sequence[Contender]) -> list[Contender]:
    """The contenders in measuring order: each row of ours followed by the peers facing it."""
    order = []
    for contender in contenders:
        if contender.ours is None:
            order.append(contender)
            order += [peer for peer in contenders if peer.ours == contender.name]
    named = {c.name for c in order}
    return order + [c for c in contenders if c.name not in named]


def _rate_of(cycle: Callable[[], object], seconds: float) -> Callable[[], float]:
    return lambda: rate(cycle, seconds)


def _handoffs_of(run: Callable[[int], list[float]], count: int) -> Callable[[], list[float]]:
    return lambda: run(count)


COMPARED = [
    "lock",
    "cycles/s",
    "handoff p50 ms",
    "handoff p90 ms",
    "ours",
    "cycles/s, ours / it",
    "handoff p50, ours / it",
]


def compared_rows(
    contenders: Sequence[Contender], results: dict[str, Measured]
) -> list[list[object]]:
    """The rows of a side-by-side table (columns: COMPARED): medians over the rounds, and for
    a peer the median of the round-by-round ratios of the keel-lock row it faces to it, with
    their least and most across rounds."""
    rows: list[list[object]] = []
    for contender in contenders:
        mine = results[contender.name]
        row: list[object] = [contender.name, _median_or_dash(mine.rates)]
        pooled = [ms for each in mine.handoffs for ms in each]
        row += [percentile(pooled, 50), percentile(pooled, 90)] if pooled else ["-", "-"]
        row.append(contender.ours or "")
        if contender.ours:
            ours = results[contender.ours]
            row.append(_ratio_or_dash(ours.rates, mine.rates))
            row.append(_ratio_or_dash(_p50s(ours.handoffs), _p50s(mine.handoffs)))
        else:
            row += ["", ""]
        rows.append(row)
    return rows


def _median_or_dash(values: Sequence[float]) -> float | str:
    return statistics.median(values) if values else "-"


def _ratio_or_dash(ours: Sequence[float], theirs: Sequence[float]) -> Spread | str:
    return ratio_spread(ours, theirs) if ours and theirs else "-"


def _p50s(rounds: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(each) for each in rounds]


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
        if value >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
