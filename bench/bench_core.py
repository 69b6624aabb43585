"""What the core costs on its own: memory-store acquire+release cycles/s the ways people write
them, side by side in one run: a new handle per `with lock(key, store=...)` (the usual way),
one handle reused, `run()` on a new handle, and `@locked`.

    .venv/bin/python -m bench.bench_core [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable

from .common import interleaved_rates, print_table, setup_django

#: Cycles per call of a timed function, so the timing loop's own cost is spread thin.
BATCH = 20


def _batched(cycle: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(BATCH):
            cycle()

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per figure, in slices")
    args = parser.parse_args(argv)
    setup_django()
    from django_keel_lock import lock, locked

    key = f"bench:core:{uuid.uuid4().hex}"
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

    cycles: dict[str, Callable[[], object]] = {
        "with lock(key) (new handle)": new_handle,
        "with handle (reused)": reused_handle,
        "lock(key).run(fn)": run_new,
        "@locked": lambda: decorated(1),
    }
    rates = interleaved_rates(
        {label: _batched(cycle) for label, cycle in cycles.items()}, args.seconds * len(cycles)
    )
    print(f"{os.cpu_count()} CPUs; memory store, about {args.seconds:g}s per figure")
    rows: list[list[object]] = [
        [label, rates[label] * BATCH, 1e6 / (rates[label] * BATCH)] for label in cycles
    ]
    print_table(["cycle", "cycles/s", "us"], rows)


if __name__ == "__main__":
    main()
