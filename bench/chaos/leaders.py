"""Chaos for `manage.py locks lead`: three nodes keep one command running between them while
leaders are killed, stopped and their store faulted.

    python -m bench.chaos.leaders --store postgres,redis --seconds 60 --ttl 2 --seed 1

Per store (the chaos harness's targets: `bench.chaos.stores`), three nodes run
`locks lead chaos-leader -- <writer>`, restarted when they exit as a process manager would.
The writer (this module's `--writer`) adds one to the fenced resource's row every 20 ms with
`fenced_update(..., fence=$KEEL_LOCK_FENCE)` and logs each write, accepted or refused. The
nemesis, every `--interval` seconds: kill -9 of the leader, SIGSTOP of the leader for longer
than the ttl (then SIGCONT), SIGTERM of the leader, or one of the store's own faults
(connections cut, stalled, sessions terminated, a server restarted). An observer reads who
leads from the store every 50 ms. Rules:

1. No write from a stale term is accepted: in the order PostgreSQL accepted the writes (the
   audit trigger's ids), the terms never go down.
2. Never two commands with valid terms at once: each term's accepted writes form one run in
   that order (no term writes again once a later term has written).
3. After every fault a leader again within ttl + 1 s: a term newer than the faulted leader's
   in the store (kill, stop, SIGTERM: counted from the fault), or any leader once a store
   fault has ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import print_table

from .stores import SOCKET_TIMEOUT, TARGETS

NAME = "chaos-leader"
RESOURCE = "leader"
ROOT = Path(__file__).resolve().parents[2]
HEADERS = (
    "store",
    "seconds",
    "faults",
    "terms",
    "writes accepted/refused",
    "rule 1",
    "rule 2",
    "rule 3",
    "max to a leader (s)",
)


# -- the command the leader runs ----------------------------------------------------------
def writer(log: str) -> int:
    """Write the resource under $KEEL_LOCK_FENCE every 20 ms, logging each write."""
    import django

    django.setup()
    from django.db.models import F

    from django_keel_lock.fencing import fenced_update

    from .models import Resource

    term = int(os.environ["KEEL_LOCK_FENCE"])
    rows = Resource.objects.filter(key=RESOURCE)
    with open(log, "a") as out:
        while True:
            sent = time.time()
            written = fenced_update(rows, fence=term, value=F("value") + 1, writer=str(term))
            out.write(json.dumps({"t0": sent, "t": time.time(), "term": term, "ok": written}))
            out.write("\n")
            out.flush()
            time.sleep(0.02)


# -- the nodes ------------------------------------------------------------------------------
class Nodes:
    """Three `locks lead` processes, each started again when it exits (after 0.5 s)."""

    def __init__(self, folder: Path, ttl: float) -> None:
        self.folder, self.ttl = folder, ttl
        self.procs: list[subprocess.Popen[bytes]] = [self._start(n) for n in range(3)]
        self.running = True
        self._watch = threading.Thread(target=self._keep, daemon=True)
        self._watch.start()

    def _start(self, n: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "django", "locks", "lead", NAME, "--ttl", str(self.ttl),
                   "--grace", "1", "--", sys.executable, "-m", "bench.chaos.leaders",
                   "--writer", str(self.folder / f"writes-{n}.jsonl")]  # fmt: skip
        stderr = open(self.folder / f"node-{n}.log", "ab")  # noqa: SIM115 - the child keeps it
        return subprocess.Popen(command, cwd=ROOT, env=os.environ.copy(), stderr=stderr)

    def _keep(self) -> None:
        while self.running:
            for n, proc in enumerate(self.procs):
                if proc.poll() is not None and self.running:
                    time.sleep(0.5)
                    self.procs[n] = self._start(n)
            time.sleep(0.05)

    def by_holder(self, holder: str) -> subprocess.Popen[bytes] | None:
        pid = holder.rsplit(":", 1)[-1]
        return next((p for p in self.procs if str(p.pid) == pid and p.poll() is None), None)

    def stop(self) -> None:
        self.running = False
        self._watch.join()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Observer:
    """Who leads, read from the store every 50 ms: (time, term or None); failed reads left out."""

    def __init__(self) -> None:
        from django_keel_lock import election

        self.election = election(NAME)
        self.samples: list[tuple[float, int | None]] = []
        self.running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from django_keel_lock import LockStoreUnavailable

        while self.running:
            try:
                leader = self.election.current()
            except LockStoreUnavailable:
                leader = False  # type: ignore[assignment]
            if leader is not False:
                self.samples.append((time.time(), None if leader is None else leader.term))
            time.sleep(0.05)

    def leader(self) -> Any:
        try:
            return self.election.current()
        except Exception:
            return None

    def stop(self) -> None:
        self.running = False
        self._thread.join()


# -- the nemesis ----------------------------------------------------------------------------
def _signal_leader(
    nodes: Nodes, observer: Observer, kind: str, rng: random.Random
) -> dict[str, Any]:
    leader = observer.leader()
    proc = None if leader is None else nodes.by_holder(leader.holder)
    if proc is None:
        return {"skipped": "no leader found"}
    fault: dict[str, Any] = {"term": leader.term, "pid": proc.pid}
    if kind == "kill":
        proc.kill()
    elif kind == "term":
        proc.terminate()
    else:
        proc.send_signal(signal.SIGSTOP)
        fault["stopped"] = time.time()
        time.sleep(rng.uniform(nodes.ttl + 0.5, nodes.ttl + 2))
        proc.send_signal(signal.SIGCONT)
    return fault


def nemesis(
    nodes: Nodes, observer: Observer, store_faults: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    kinds = ["kill", "stop", "term", *(f"store:{name}" for name in sorted(store_faults))]
    until = time.monotonic() + args.seconds - 2 * args.ttl
    faults = []
    time.sleep(args.interval)
    while time.monotonic() < until:
        kind = rng.choice(kinds)
        fault: dict[str, Any] = {"kind": kind, "t0": time.time()}
        if kind.startswith("store:"):
            fault.update(store_faults[kind[6:]](rng) or {})
        else:
            fault.update(_signal_leader(nodes, observer, kind, rng))
        fault["t1"] = time.time()
        faults.append(fault)
        time.sleep(rng.uniform(args.interval / 2, args.interval * 1.5))
    return faults


# -- the checks -----------------------------------------------------------------------------
def check(
    audit: list[int], faults: list[dict[str, Any]], samples: list[Any], ttl: float
) -> dict[str, Any]:
    """The rules over the audit's fences (in accepted order), the faults and the samples."""
    highest = [max(audit[: i + 1]) for i in range(len(audit))]
    stale = [(i, f) for i, f in enumerate(audit) if i and f < highest[i - 1]]
    rerun = reruns(audit)
    waits = []
    for fault in faults:
        if fault.get("skipped"):
            continue
        process = not fault["kind"].startswith("store:")
        start = fault["t0"] if process else fault["t1"]
        old = fault.get("term", -1) if process else -1
        found = next(
            (t for t, term in samples if t >= start and term is not None and term > old), None
        )
        waits.append(float("inf") if found is None else found - start)
    return {
        "rule1": stale,
        "rule2": rerun,
        "rule3": [w for w in waits if w > ttl + 1],
        "max_wait": max(waits, default=0.0),
    }


def reruns(audit: list[int]) -> list[int]:
    """The terms that wrote again after a later term had written (in accepted order)."""
    done: set[int] = set()
    again: set[int] = set()
    previous = None
    for fence in audit:
        if fence != previous:
            if fence in done:
                again.add(fence)
            if previous is not None:
                done.add(previous)
            previous = fence
    return sorted(again)


def run_store(name: str, args: argparse.Namespace) -> list[object]:
    run = f"leaders-{uuid.uuid4().hex[:6]}"
    target = TARGETS[name](run)
    folder = Path(tempfile.mkdtemp(prefix=f"keel-chaos-{name}-"))
    try:
        config = {**target.open(), "keys": [], "ttl": args.ttl, "until": 0,
                  "socket_timeout": SOCKET_TIMEOUT}  # fmt: skip
        os.environ["KEEL_CHAOS_CONFIG"] = json.dumps(config)
        os.environ["DJANGO_SETTINGS_MODULE"] = "bench.chaos.settings"
        os.environ["PYTHONPATH"] = str(ROOT)
        _prepare()
        observer = Observer()
        nodes = Nodes(folder, args.ttl)
        try:
            faults = nemesis(nodes, observer, target.faults, args)
            time.sleep(2 * args.ttl)
        finally:
            nodes.stop()
            observer.stop()
        audit = _audit()
    finally:
        target.close()
    writes = [json.loads(line) for path in folder.glob("writes-*.jsonl")
              for line in path.read_text().splitlines() if line.endswith("}")]  # fmt: skip
    result = check(audit, faults, observer.samples, args.ttl)
    (folder / "faults.json").write_text(json.dumps(faults))
    accepted = sum(1 for w in writes if w["ok"])
    broken = result["rule1"] or result["rule2"] or result["rule3"]
    kinds = ", ".join(sorted({f["kind"] for f in faults}))
    tail = "; RULES BROKEN: " + json.dumps(result) if broken else ""
    print(f"{name}: {len(faults)} faults ({kinds}); history in {folder}{tail}")
    return [
        name,
        args.seconds,
        len([f for f in faults if not f.get("skipped")]),
        len(set(audit)),
        f"{accepted}/{len(writes) - accepted}",
        "ok" if not result["rule1"] else f"{len(result['rule1'])} stale",
        "ok" if not result["rule2"] else f"terms {result['rule2']}",
        "ok" if not result["rule3"] else f"{len(result['rule3'])} late",
        f"{result['max_wait']:.2f}",
    ]


def _prepare() -> None:
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    from .models import SCHEMA

    if "store" in settings.DATABASES:
        call_command("migrate", database="store", verbosity=0)
    with connections["default"].cursor() as cursor:
        cursor.execute(SCHEMA)
        cursor.execute("INSERT INTO keel_chaos_resource (key) VALUES (%s)", [RESOURCE])


def _audit() -> list[int]:
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT fence FROM keel_chaos_audit WHERE key = %s ORDER BY id", [RESOURCE])
        return [row[0] for row in cursor.fetchall()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.leaders")
    parser.add_argument("--store", default="postgres,redis")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.writer:
        return writer(args.writer)
    rows = []
    for name in args.store.split(","):
        if args.one or len(args.store.split(",")) == 1:
            rows.append(run_store(name, args))
            continue
        # Each store in a process of its own: Django is set up once per process.
        summary = tempfile.mktemp(suffix=".json")
        options = [f"--{o}={getattr(args, o)}" for o in ("seconds", "ttl", "interval", "seed")]
        command = [sys.executable, "-m", "bench.chaos.leaders", "--store", name, "--one", *options]
        subprocess.run(command, env={**os.environ, "KEEL_CHAOS_LEADERS_SUMMARY": summary})
        if os.path.exists(summary):
            rows.append(json.loads(Path(summary).read_text()))
            os.remove(summary)
    summary_path = os.environ.get("KEEL_CHAOS_LEADERS_SUMMARY")
    if summary_path and len(rows) == 1:
        Path(summary_path).write_text(json.dumps(rows[0]))
        return 0
    print_table(HEADERS, rows)
    return 1 if any(row[5:8] != ["ok"] * 3 for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
