"""Redis store benchmark, side by side on the same Redis: uncontended acquire+release cycles/s,
cross-process handoff latency, and fairness of 8 processes on one key.

Compared: our RedisLockStore (through the public Lock handle), redis-py's `Lock`,
python-redis-lock, pottery's `Redlock`, and a raw redis-py "SET NX PX + compare-and-delete
EVALSHA" loop as the floor. Every contender is measured in short alternating rounds of one
run; the ratios are the median of the round-by-round ratios, with their least and most.

    .venv/bin/python -m bench.bench_redis [--rounds 20] [--seconds 0.1] [--handoffs 2]
        [--fair-seconds 2] [--only keel-lock,python-redis-lock]
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .common import COMPARED, HandoffRig, Pair, compared_rows, measure, print_table, round_options
from .common import Contender as Row

COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
TTL = 30  # seconds; nothing here should ever expire


def setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()


def redis_url() -> str:
    from django.conf import settings

    return str(settings.REDIS_URL)


def raw_client() -> Any:
    import redis

    return redis.Redis.from_url(redis_url())


class Contender:
    """One lock implementation reduced to: make a handle on a key, try, block, release."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = raw_client()
        self._sha = self.client.script_load(COMPARE_AND_DELETE)

    def handle(self, key: str) -> Any:
        name, client = self.name, self.client
        if name == "keel-lock":
            from django_keel_lock import lock

            return lock(key, ttl=TTL, store="redis")
        if name == "redis-py Lock":
            return client.lock(key, timeout=TTL)
        if name == "python-redis-lock":
            import redis_lock

            return redis_lock.Lock(client, key, expire=TTL)
        if name == "pottery Redlock":
            from pottery import Redlock

            return Redlock(key=key, masters={client}, auto_release_time=TTL)
        return _RawLock(client, key, self._sha)

    def try_acquire(self, handle: Any) -> bool:
        if self.name == "keel-lock":
            return bool(handle.acquire())
        return bool(handle.acquire(blocking=False))

    def block(self, handle: Any) -> bool:
        """Each library's own blocking acquire, with its defaults for how to wait."""
        if self.name == "keel-lock":
            return bool(handle.acquire(timeout=20))
        if self.name == "redis-py Lock":
            return bool(handle.acquire(blocking=True, blocking_timeout=20))
        if self.name == "pottery Redlock":
            return bool(handle.acquire(blocking=True, timeout=20))
        return bool(handle.acquire(blocking=True, timeout=20))

    @staticmethod
    def release(handle: Any) -> None:
        handle.release()


class _RawLock:
    """The floor: SET NX PX, compare-and-delete by EVALSHA, and a 1 ms poll to block."""

    def __init__(self, client: Any, key: str, sha: str) -> None:
        self.client, self.key, self.sha = client, key, sha
        self.token = b""

    def acquire(self, blocking: bool = True, timeout: float = 20) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            token = secrets.token_hex(16).encode()
            if self.client.set(self.key, token, nx=True, px=TTL * 1000):
                self.token = token
                return True
            if not blocking or time.monotonic() > deadline:
                return False
            time.sleep(0.001)

    def release(self) -> None:
        self.client.evalsha(self.sha, 1, self.key, self.token)


#: In measuring order: the peers whose ratios matter most next to ours.
CONTENDERS = ["keel-lock", "python-redis-lock", "raw SET NX PX + EVALSHA", "redis-py Lock"]
CONTENDERS += ["pottery Redlock"]


def _cycle(contender: Contender) -> Callable[[], None]:
    handle = contender.handle(f"bench:cycle:{uuid.uuid4().hex}")

    def cycle() -> None:
        assert contender.try_acquire(handle)
        contender.release(handle)

    return cycle


def _pair(name: str, key: str) -> Pair:
    """Take (each library's own blocking acquire, on a new handle) and give, on `key`."""
    contender = Contender(name)
    held: list[Any] = []

    def take() -> None:
        handle = contender.handle(key)
        assert contender.block(handle), "never got the lock"
        held.append(handle)

    return take, lambda: contender.release(held.pop())


def row(name: str) -> Row:
    """The contender `name` as a row of the side-by-side table, its handoff waiter started."""
    key = f"bench:handoff:{uuid.uuid4().hex}"
    rig = HandoffRig(lambda: _pair(name, key))
    ours = None if name == "keel-lock" else "keel-lock"
    return Row(name, _cycle(Contender(name)), rig.run, ours)


def _fair_worker(key: str, seconds: float, start_at: float, pipe: Connection) -> None:
    from django_keel_lock import lock

    handle = lock(key, ttl=TTL, store="redis")
    handle.store.watch(key).__enter__()  # subscribe before the race starts
    while time.monotonic() < start_at:
        time.sleep(0.001)
    count, end = 0, start_at + seconds
    while time.monotonic() < end:
        if handle.acquire(timeout=10):
            count += 1
            handle.release()
    pipe.send(count)


def fairness(processes: int, seconds: float) -> list[int]:
    """Acquisitions per process when `processes` loop acquire/release on one key at once."""
    key = f"bench:fair:{uuid.uuid4().hex}"
    start_at = time.monotonic() + 1.0
    pipes, procs = [], []
    for _ in range(processes):
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=_fair_worker, args=(key, seconds, start_at, child), daemon=True
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    counts = [int(pipe.recv()) for pipe in pipes]
    for proc in procs:
        proc.join(5)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = round_options(__doc__)
    parser.add_argument("--fair-seconds", type=float, default=2.0)
    parser.add_argument("--only", default="", help="comma-separated contenders to run")
    args = parser.parse_args(argv)
    setup()
    names = [n for n in CONTENDERS if not args.only or n in args.only.split(",")]
    print(
        f"Redis at {redis_url()}; {os.cpu_count()} CPUs; {args.rounds} rounds of "
        f"{args.seconds:g}s per cycles/s and of {args.handoffs} handoffs per contender"
    )
    rows = [row(name) for name in names]
    results = measure(rows, args.rounds, args.seconds, args.handoffs)
    print_table(COMPARED, compared_rows(rows, results))
    if "keel-lock" in names and args.fair_seconds > 0:
        counts = fairness(8, args.fair_seconds)
        mean = sum(counts) / len(counts)
        print(
            f"8 processes on one key for {args.fair_seconds:g}s: {sum(counts)} acquisitions, "
            f"per process {counts}; least share {min(counts) / mean:.2f} of the mean"
        )


if __name__ == "__main__":
    main()
