"""etcd next to Redis and PostgreSQL, in one run: uncontended acquire+release cycles/s of an
exclusive lock, and the handoff of a released lock to a waiter blocked in another process.

etcd is a 3-member cluster on loopback started for the run (tests/support/etcd.py: Debian's
etcd 3.4, 50 ms heartbeat, 500 ms election timeout); Redis and PostgreSQL are bench.settings'
servers. Every etcd write is a Raft commit on two of three members, fsynced.

    .venv/bin/python -m bench.bench_etcd [--seconds 2] [--rounds 40]
"""

from __future__ import annotations

import argparse
import os

from .bench_modes import _cycle, handoff
from .common import interleaved_rates, percentile, print_table, setup_django

COMPARED = ["postgres", "redis"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per cycles/s figure")
    parser.add_argument("--rounds", type=int, default=40, help="handoffs per store")
    args = parser.parse_args(argv)
    setup_django()
    from django.conf import settings

    from django_keel_lock import set_lock_store
    from django_keel_lock.stores import EtcdLockStore
    from tests.support.etcd import etcd_cluster

    stores = [alias for alias in COMPARED if alias in settings.KEEL_LOCK_STORES]
    with etcd_cluster() as cluster:
        store = EtcdLockStore("etcd", {"ENDPOINTS": cluster.endpoints})
        set_lock_store(store, "etcd")
        aliases = ["etcd", *stores]
        print(f"{os.cpu_count()} CPUs; cycles over {args.seconds:g}s per store, interleaved")
        rates = interleaved_rates(
            {alias: _cycle(alias, {}) for alias in aliases}, args.seconds * len(aliases)
        )
        rows: list[list[object]] = []
        for alias in aliases:
            samples = handoff(alias, {}, args.rounds)
            ratio = rates[alias] / rates["etcd"]
            p50, p90 = percentile(samples, 50), percentile(samples, 90)
            rows.append([alias, rates[alias], f"{ratio:.2f}", p50, p90])
        set_lock_store(None, "etcd")
        store.close()
    print_table(["store", "cycles/s", "x etcd", "handoff p50 ms", "handoff p90 ms"], rows)


if __name__ == "__main__":
    main()
