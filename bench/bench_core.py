"""What the core costs on its own: memory-store acquire+release cycles the ways people write
them: a new handle per `with lock(key, store="memory")` (the usual way), one handle reused,
`run()` on a new handle, and `@locked`. Cycles/s in short alternating rounds of one run (the
median round, and the slowest and fastest), and instructions per cycle under valgrind's
callgrind (bench.callgrind), which do not move with the machine's load.

    .venv/bin/python -m bench.bench_core [--rounds 20] [--seconds 0.1] [--no-callgrind]
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid
from collections.abc import Callable

from .common import alternate, print_table, rate, setup_django

#: Cycles per call of a timed function, so the timing loop's own cost is spread thin.
BATCH = 20
NEW_HANDLE = "with lock(key) (a new handle)"
CYCLES = [NEW_HANDLE, "with handle (reused)", "lock(key).run(fn)", "@locked"]


def core_cycles(key: str) -> dict[str, Callable[[], object]]:
    """One acquire+release on the memory store, each way of CYCLES (Django set up)."""
    from django_keel_lock import lock, locked

    reused = lock(key, store="memory")

    def new_handle() -> None:
        with lock(key, store="memory"):
            pass

    def reused_handle() -> None:
        with reused:
            pass

    def run_new() -> None:
        lock(key, store="memory").run(lambda: None)

    @locked(key + ":{n}", store="memory")
    def decorated(n: int) -> None:
        pass

    ways = [new_handle, reused_handle, run_new, lambda: decorated(1)]
    return dict(zip(CYCLES, ways, strict=True))


def _batched(cycle: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(BATCH):
            cycle()

    return run


def _rounds(seconds: float, cycle: Callable[[], object]) -> Callable[[], float]:
    batched = _batched(cycle)
    return lambda: rate(batched, seconds) * BATCH


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds")
    parser.add_argument("--seconds", type=float, default=0.1, help="per cycle and round")
    parser.add_argument("--no-callgrind", action="store_true", help="no instruction counts")
    args = parser.parse_args(argv)
    setup_django()
    from . import callgrind

    cycles = core_cycles(f"bench:core:{uuid.uuid4().hex}")
    rates = alternate(
        {name: _rounds(args.seconds, cycle) for name, cycle in cycles.items()}, args.rounds
    )
    counted = not args.no_callgrind and callgrind.available()
    counts = callgrind.instructions(CYCLES) if counted else {}
    print(
        f"{os.cpu_count()} CPUs; memory store, {args.rounds} rounds of {args.seconds:g}s per "
        f"cycle; instructions: {'callgrind' if counted else 'not counted (no valgrind)'}"
    )
    rows: list[list[object]] = []
    for name, each in rates.items():
        median = statistics.median(each)
        spread = f"{min(each):,.0f}-{max(each):,.0f}"
        rows.append([name, median, spread, 1e6 / median, counts.get(name, "-")])
    print_table(["cycle", "cycles/s", "slowest-fastest round", "µs", "instructions"], rows)


if __name__ == "__main__":
    main()
