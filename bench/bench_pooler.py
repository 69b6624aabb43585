"""The database store on PostgreSQL behind poolers, beside the direct connection: uncontended
cycles/s and cross-process handoff latency through a PgBouncer in transaction mode (a pool of
4 server connections, started here on a free port) with the listener on a direct connection
(OPTIONS LISTEN_DATABASE) and without one (waiters poll), and with Django's own pool
(psycopg_pool). Every contender is measured in short alternating rounds of one run; a ratio is
the median of the round-by-round ratios to the direct store, with its middle half and range.

    .venv/bin/python -m bench.bench_pooler [--rounds 20] [--seconds 0.1] [--handoffs 2]
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from typing import Any

from .bench_db import store_cycle, store_pair
from .common import (
    Contender,
    HandoffRig,
    Measured,
    measure,
    percentile,
    print_table,
    ratio_spread,
    round_options,
    setup_django,
)

DIRECT = "direct"
#: contender -> (its DATABASES entry's change to the bench's "postgres", its store OPTIONS)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    DIRECT: ("postgres", {}),
    "pgbouncer, listener direct": ("pgbouncer", {"LISTEN_DATABASE": "postgres"}),
    "pgbouncer, waiters poll": ("pgbouncer", {}),
    "Django's pool": ("django-pool", {}),
}


def _databases(stack: ExitStack) -> None:
    """The bench's "pgbouncer" and "django-pool" DATABASES aliases, and a store per variant
    (its alias: the variant's name)."""
    from django.conf import settings
    from django.db import connections

    from django_keel_lock.registry import reset_stores
    from tests.support.pgbouncer import pgbouncer

    direct = dict(connections.settings["postgres"])
    bouncer = stack.enter_context(pgbouncer(direct, pool_size=4))
    connections.settings["pgbouncer"] = bouncer.settings(direct)
    pool = {"min_size": 1, "max_size": 4}
    connections.settings["django-pool"] = {
        **direct,
        "OPTIONS": {**(direct.get("OPTIONS") or {}), "pool": pool},
    }
    for name, (database, options) in VARIANTS.items():
        settings.KEEL_LOCK_STORES[name] = {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": database, **options},
        }
    reset_stores()


def main() -> None:
    args = round_options(__doc__).parse_args()
    setup_django()
    with ExitStack() as stack:
        _databases(stack)
        keys = {name: f"bench:pooler:handoff:{uuid.uuid4().hex}" for name in VARIANTS}
        rigs = {
            name: HandoffRig(lambda name=name: store_pair(name, keys[name])) for name in VARIANTS
        }
        contenders = [
            Contender(name, cycle=store_cycle(name), handoffs=rigs[name].run) for name in VARIANTS
        ]
        results = measure(contenders, args.rounds, args.seconds, args.handoffs)
        for rig in rigs.values():
            rig.stop()
    print(
        f"django-keel-lock on PostgreSQL behind poolers: {args.rounds} alternating rounds of "
        f"{args.seconds:g}s per cycles/s and of {args.handoffs} handoffs per figure; waiters "
        "poll every retry_delay (0.05 s); ratios to the direct store: median (middle half; "
        "least-most)"
    )
    print_table(
        ["store", "cycles/s", "handoff p50 ms", "handoff p90 ms", "cycles/s / direct",
         "handoff p50 / direct"],
        [_row(name, results) for name in VARIANTS],
    )  # fmt: skip


def _row(name: str, results: dict[str, Measured]) -> list[object]:
    import statistics

    mine, direct = results[name], results[DIRECT]
    pooled = [ms for each in mine.handoffs for ms in each]
    row: list[object] = [name, statistics.median(mine.rates)]
    row += [percentile(pooled, 50), percentile(pooled, 90)]
    if name == DIRECT:
        return [*row, "", ""]
    p50s = [statistics.median(each) for each in mine.handoffs]
    direct_p50s = [statistics.median(each) for each in direct.handoffs]
    return [*row, ratio_spread(mine.rates, direct.rates), ratio_spread(p50s, direct_p50s)]


if __name__ == "__main__":
    main()
