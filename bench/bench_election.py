"""Leader election: how long until a candidate leads, after the leader resigns, gets SIGTERM
or is killed with SIGKILL; beside a polling loop's candidate in the same run.

Every candidate is a process of its own (spawned, Django set up). `push`: the candidate
campaigns with `election().campaign()`, waiting in the key's line for the release's wake-up.
`poll`: the candidate tries `lock().acquire()` (no wait) every `--poll` seconds, as
single-beat's heartbeat (1 s by default) and hand-written cron wrappers do; its leader
releases the lock on SIGTERM as the election's does. `resign` is measured from just before
the leader's resign() (or release()) call, `sigterm` and `kill -9` from just before the bench
sends the signal (SIGTERM: the election's handler resigns, then the process dies of it), each
to the moment the candidate's campaign returned (wall clocks of one machine).

    .venv/bin/python -m bench.bench_election [--stores postgres,redis,mariadb,sqlite]
        [--rounds 10] [--kills 3] [--ttl 2] [--poll 1]

Targets (issue 32): kill -9 <= ttl + 200 ms; resign and SIGTERM <= 50 ms p50 on PostgreSQL
and Redis (push).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from .common import percentile, print_table, setup_django

STORES = ["postgres", "redis", "mariadb", "sqlite"]


def _campaign(alias: str, key: str, ttl: float, mode: str, poll: float) -> tuple[Any, int]:
    """Lead (push: the election's wait; poll: a try every `poll` s); (what leads, term)."""
    from django_keel_lock import election, lock

    if mode == "push":
        leader = election(key, ttl=ttl, store=alias)
        return leader, leader.campaign()
    handle = lock(f"election:{key}", ttl=ttl, store=alias, auto_extend=True)
    while not handle.acquire():
        time.sleep(poll)
    assert handle.fence is not None

    def release_and_die(signum: int, frame: object) -> None:  # as the election's handler does
        handle.release()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, release_and_die)
    return handle, handle.fence


def worker(conn: Connection, alias: str, key: str, ttl: float, mode: str, poll: float) -> None:
    """One candidate: set up, say "ready", campaign when told, say when elected; resign or
    exit when told."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()  # the parent created and migrated the databases
    from django_keel_lock import election

    election(key, ttl=ttl, store=alias)  # imports and the store's connection, before timing
    conn.send(("ready",))
    leading: Any = None
    while True:
        command = conn.recv()[0]
        if command == "campaign":
            leading, term = _campaign(alias, key, ttl, mode, poll)
            conn.send(("elected", time.time(), term))
        elif command == "resign":
            sent = time.time()
            leading.resign() if hasattr(leading, "resign") else leading.release()
            conn.send(("resigned", sent))
        else:
            return


class Candidate:
    def __init__(self, alias: str, key: str, ttl: float, mode: str, poll: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.proc = context.Process(
            target=worker, args=(child, alias, key, ttl, mode, poll), daemon=True
        )
        self.proc.start()

    def ready(self) -> None:
        assert self.conn.recv()[0] == "ready"

    def campaign(self) -> None:
        self.conn.send(("campaign",))

    def elected(self, timeout: float = 60) -> float:
        if not self.conn.poll(timeout):
            raise TimeoutError("no leader")
        message = self.conn.recv()
        assert message[0] == "elected", message
        return float(message[1])

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def takeovers(
    alias: str, event: str, mode: str, rounds: int, ttl: float, poll: float
) -> list[float]:
    """Seconds from the leader's end (`event`) to the next leader, `rounds` times: a chain of
    processes, each elected in turn (`resign`: two that swap roles)."""
    key = f"bench-election:{uuid.uuid4().hex[:8]}"
    rng = random.Random(f"{alias}-{event}-{mode}")
    count = 2 if event == "resign" else rounds + 1
    chain = [Candidate(alias, key, ttl, mode, poll) for _ in range(count)]
    try:
        for candidate in chain:
            candidate.ready()
        leader = chain[0]
        leader.campaign()
        leader.elected()
        times = []
        for n in range(rounds):
            nxt = chain[1 - chain.index(leader)] if event == "resign" else chain[n + 1]
            nxt.campaign()
            # In the line (push), or polling (poll): at a moment of its period drawn at
            # random, as a leader's end would fall.
            time.sleep(0.3 + rng.uniform(0, poll))
            if event == "resign":
                leader.conn.send(("resign",))
                reply = leader.conn.recv()
                ended = float(reply[1])  # it campaigns again in the next round
            else:
                ended = time.time()
                os.kill(leader.proc.pid, signal.SIGTERM if event == "sigterm" else signal.SIGKILL)
            times.append(nxt.elected(timeout=ttl + 30) - ended)
            leader = nxt
        return times
    finally:
        for candidate in chain:
            candidate.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--rounds", type=int, default=10, help="resign and SIGTERM rounds")
    parser.add_argument("--kills", type=int, default=3, help="kill -9 rounds")
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--poll", type=float, default=1.0, help="the polling loop's interval")
    args = parser.parse_args()
    setup_django()
    rows = []
    for alias in args.stores.split(","):
        for mode in ("push", "poll"):
            row: list[object] = [alias, mode]
            for event, rounds in (("resign", args.rounds), ("sigterm", args.rounds)):
                times = takeovers(alias, event, mode, rounds, args.ttl, args.poll)
                row += [f"{percentile(times, 50) * 1000:.0f}", f"{max(times) * 1000:.0f}"]
            if mode == "push":
                kills = takeovers(alias, "kill", mode, args.kills, args.ttl, args.poll)
                row += [f"{max(kills) * 1000:.0f}"]
            else:
                row += ["-"]
            rows.append(row)
            print(row, flush=True)
    print(f"\nTakeover, ms (ttl {args.ttl:g} s; poll every {args.poll:g} s; "
          f"{args.rounds} resign/SIGTERM rounds, {args.kills} kill -9 rounds):\n")  # fmt: skip
    print_table(
        [
            "store",
            "candidate",
            "resign p50",
            "resign max",
            "SIGTERM p50",
            "SIGTERM max",
            f"kill -9 max (<= {args.ttl * 1000 + 200:.0f})",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
