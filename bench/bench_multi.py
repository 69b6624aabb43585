"""Many keys at once: cycles/s of one multi-key lock (`with lock([k1, ..., kn])`) beside
taking the same keys one by one with single-key locks (`with lock(k1): with lock(k2): ...`,
the sequential way), for 2 and 10 keys, on PostgreSQL and Redis (and memory, the floor).

A cycle takes the keys and gives them back, uncontended; each cycle builds its handles, as
a caller does. Contenders take turns in short alternating rounds (see `common.alternate`);
the table shows the median cycles/s and the round-by-round ratio of the multi-key lock to
the sequential way, with its spread. "store path" says how the store takes several keys:
one atomic step of its own (`atomic_many`) or the protocol's default, one by one.

    .venv/bin/python -m bench.bench_multi [--rounds 20] [--seconds 0.1] [--stores ...]
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable

from .common import alternate, print_table, rate, ratio_spread, round_options, setup_django

STORES = ["memory", "postgres", "redis"]
SIZES = (2, 10)
TTL = 30


def contenders(alias: str, size: int) -> dict[str, Callable[[], object]]:
    """The multi-key lock and the sequential way over the same `size` keys of `alias`."""
    from django_keel_lock import lock

    run = f"bench:multi:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    keys = [f"{run}:{n}" for n in range(size)]

    def together() -> None:
        with lock(keys, store=alias, ttl=TTL):
            pass

    def one_by_one() -> None:
        with contextlib.ExitStack() as stack:
            for key in keys:
                stack.enter_context(lock(key, store=alias, ttl=TTL))

    return {"lock([...])": together, "one by one": one_by_one}


def store_path(alias: str) -> str:
    from django_keel_lock import get_lock_store

    return "one atomic step" if get_lock_store(alias).atomic_many else "default (key by key)"


HEADERS = [
    "store",
    "keys",
    "store path",
    "lock([...]) cycles/s",
    "one by one cycles/s",
    "lock([...]) / one by one (spread)",
]


def row(alias: str, size: int, rounds: int, seconds: float) -> list[object]:
    """One line of the table: `size` keys of `alias`, both ways, in alternating rounds."""
    cycles = contenders(alias, size)
    rates = alternate(
        {name: lambda c=cycle: rate(c, seconds) for name, cycle in cycles.items()}, rounds
    )
    ours, theirs = rates["lock([...])"], rates["one by one"]
    medians = [sorted(values)[len(values) // 2] for values in (ours, theirs)]
    return [alias, size, store_path(alias), *medians, str(ratio_spread(ours, theirs))]


def main(argv: list[str] | None = None) -> None:
    parser = round_options(__doc__)
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args(argv)
    setup_django()
    from django.conf import settings

    known = {"memory", "redis", *settings.DATABASES}
    print(
        f"django-keel-lock many keys at once, {os.cpu_count()} CPUs; {args.rounds} rounds of "
        f"{args.seconds:g}s per contender; cycles/s (median of rounds)"
    )
    rows = [
        row(alias, size, args.rounds, args.seconds)
        for alias in args.stores.split(",")
        if alias in known
        for size in SIZES
    ]
    print_table(HEADERS, rows)


if __name__ == "__main__":
    main()
