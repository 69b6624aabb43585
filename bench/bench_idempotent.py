"""Idempotent views: an `@idempotent` view's first request and its replay, side by side with
the same view under `@lock_view` and bare, on PostgreSQL and Redis (and memory, the floor).

Each request goes through the view function as Django calls it (a RequestFactory POST with
a JSON body and an Idempotency-Key header): a first request has a key never seen before, a
replay repeats one key already answered. The view itself does no I/O, so "bare" is what the
surfaces add nothing to. Contenders take turns in short alternating rounds; the table shows
the median microseconds per request, and its ratio to @lock_view's with the spread across
rounds. On PostgreSQL and Redis it also counts one request's round trips (`round_trips`).

    .venv/bin/python -m bench.bench_idempotent [--rounds 20] [--seconds 0.1]
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

from .common import alternate, print_table, rate, ratio_spread, round_options, setup_django

STORES = ["memory", "postgres", "redis"]
BODY = json.dumps({"amount": 1250, "currency": "eur", "customer": "cus_42"})


def answer(request: Any) -> Any:
    from django.http import JsonResponse

    return JsonResponse({"id": "pay_1", "status": "succeeded", "amount": 1250}, status=201)


def views(alias: str) -> dict[str, Callable[[], object]]:
    """The contenders on store `alias`: each a callable making one request."""
    from django.test import RequestFactory

    from django_keel_lock import idempotent, lock_view

    factory = RequestFactory()
    locked = lock_view(f"bench:{os.getpid()}:{uuid.uuid4().hex}", store=alias)(answer)
    guarded = idempotent(store=alias, scope="global", ttl="10m")(answer)
    counter = itertools.count()
    run = uuid.uuid4().hex[:8]
    replay_key = f"bench-replay-{run}"

    def request(key: str | None) -> Any:
        headers = {} if key is None else {"Idempotency-Key": key}
        return factory.post("/pay/", BODY, content_type="application/json", headers=headers)

    def first() -> object:
        response = guarded(request(f"bench-{run}-{next(counter)}"))
        assert response.status_code == 201 and "Idempotent-Replayed" not in response
        return response

    def replay() -> object:
        response = guarded(request(replay_key))
        assert response["Idempotent-Replayed"] == "true"
        return response

    guarded(request(replay_key))  # the answer every replay gets
    return {
        "bare view": lambda: answer(request(None)),
        "@lock_view": lambda: locked(request(None)),
        "@idempotent first": first,
        "@idempotent replay": replay,
    }


def round_trips(alias: str, calls: int = 20) -> dict[str, float]:
    """Round trips per request of each contender on store `alias` (postgres, redis), counted
    on the connections of a twin store whose traffic goes through a counting proxy
    (tests/support/round_trips.py): whatever else the server does, only these count."""
    from urllib.parse import urlsplit

    from django.conf import settings
    from django.db import connections

    from django_keel_lock import set_lock_store
    from django_keel_lock.stores import DatabaseLockStore, RedisLockStore
    from tests.support.round_trips import RoundTrips

    twin = f"{alias}-counted"
    if alias == "redis":
        url = urlsplit(settings.REDIS_URL)
        proxy = RoundTrips(url.hostname or "127.0.0.1", url.port or 6379).start()
        where = f"redis://127.0.0.1:{proxy.port}{url.path or '/0'}"
        store: Any = RedisLockStore(twin, {"URL": where})
    else:
        db = connections.settings[alias]
        proxy = RoundTrips(db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432)).start()
        connections.settings[twin] = {**db, "HOST": "127.0.0.1", "PORT": proxy.port}
        store = DatabaseLockStore(twin, {"DATABASE": twin, "TRANSACTION_POOLER": False})
    set_lock_store(store, twin)
    try:
        counts = {}
        for name, cycle in views(twin).items():
            cycle(), cycle()  # scripts loaded, statements prepared
            before = proxy.count
            for _ in range(calls):
                cycle()
            counts[name] = (proxy.count - before) / calls
        return counts
    finally:
        set_lock_store(None, twin)
        store.close()
        proxy.stop()


def own_redis() -> subprocess.Popen[bytes] | None:
    """A redis-server of the bench's own on a free port (REDIS_URL points at it), so that no
    one else's keys or load share it; None (the shared one is used) without the binary."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    atexit.register(server.terminate)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    return server


def main(argv: list[str] | None = None) -> None:
    parser = round_options(__doc__)
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args(argv)
    own_redis()
    setup_django()
    from django.conf import settings

    available = {"memory", "redis"} | set(settings.DATABASES)
    aliases = [alias for alias in args.stores.split(",") if alias in available]
    print(
        f"django-keel-lock idempotent views, {os.cpu_count()} CPUs; {args.rounds} rounds of "
        f"{args.seconds:g}s per contender; µs per request (median of rounds)"
    )
    headers = ["store", "view", "µs/request", "vs @lock_view (spread)", "round trips"]
    rows: list[list[object]] = []
    for alias in aliases:
        cycles = views(alias)
        rates = alternate(
            {name: lambda c=cycle: rate(c, args.seconds) for name, cycle in cycles.items()},
            args.rounds,
        )
        base = rates["@lock_view"]
        trips = round_trips(alias) if alias in ("postgres", "redis") else {}
        for name, values in rates.items():
            micros = sorted(1e6 / value for value in values)[len(values) // 2]
            spread = ratio_spread([1 / v for v in values], [1 / v for v in base])
            commands = f"{trips[name]:.1f}" if name in trips else "-"
            rows.append([alias, name, micros, str(spread), commands])
    print_table(headers, rows)


if __name__ == "__main__":
    main()
