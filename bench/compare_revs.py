"""Before and after: two git revisions of the package side by side on every store, in
alternating rounds of one run.

Each revision is checked out in a `git worktree` under /tmp and served by a worker process that
imports the package from that checkout (checked: every module of ours it loaded comes from
there) and this checkout's bench, on bench databases of its own (dropped at the end). The
coordinator asks the two workers in turns (A, B, B, A, ...) for one short round of a figure, so
the machine's drift lands on both alike; per store it prints each figure's median for A and
B and the median of the round-by-round ratios B / A, with their least and most. Running a
revision against itself (A/A) shows the noise floor. The memory store's instructions per
cycle come from callgrind (one run per revision: they do not drift).

    .venv/bin/python -m bench.compare_revs REV_A REV_B [--stores memory,redis]
        [--rounds 30] [--seconds 0.1] [--handoffs 4] [--no-callgrind] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import callgrind
from .bench_core import CYCLES
from .common import (
    HandoffRig,
    alternate,
    drop_databases,
    percentile,
    print_table,
    rate,
    ratio_spread,
    round_options,
    verdict,
)

STORES = ["memory", "sqlite", "postgres", "postgres-fast", "mariadb", "redis"]
REPO = callgrind.REPO


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", REPO, *args], check=True, capture_output=True, text=True
    ).stdout.strip()


class Failed(Exception):
    """A worker could not measure a figure (its store refused, its revision broke)."""


class Side:
    """One revision: its worktree under `root` and the worker serving it."""

    def __init__(self, label: str, rev: str, root: str) -> None:
        self.label, self.rev = label, rev
        self.sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        self.tree = os.path.join(root, label)
        git("worktree", "add", "--detach", self.tree, self.sha)
        # Databases of this run's and side's own (the revision's migrations), dropped at the end.
        self.database = f"keel_lock_compare_{os.getpid()}_{label}"
        env = {**os.environ, "KEEL_BENCH_DB": self.database}
        env.pop("PYTHONPATH", None)
        command = [
            sys.executable,
            "-c",
            callgrind.BOOT,
            self.tree,
            REPO,
            "bench.compare_revs",
            "--serve",
        ]
        self.worker = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
        )

    @property
    def name(self) -> str:
        named = "" if self.sha.startswith(self.rev) else f" ({self.sha[:7]})"
        return f"{self.label.upper()} {self.rev}{named}"

    def ask(self, **request: Any) -> Any:
        assert self.worker.stdin and self.worker.stdout
        self.worker.stdin.write(json.dumps(request) + "\n")
        self.worker.stdin.flush()
        answer = self.worker.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker of {self.name} ended (its errors are above)")
        reply = json.loads(answer)
        if isinstance(reply, dict) and "failed" in reply:
            raise Failed(f"{self.name}: {reply['failed']}")
        return reply

    def close(self, keep: bool) -> None:
        """Stop the worker (ended it if it does not stop), drop its databases and, unless
        `keep`, remove the worktree, whatever state the run left them in."""
        try:
            if self.worker.poll() is None:
                self.ask(op="stop")
                self.worker.wait(30)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.worker.kill()
            self.worker.wait(10)
        drop_databases(self.database)
        if not keep:
            git("worktree", "remove", "--force", self.tree)


# The worker ------------------------------------------------------------------------------


class Worker:
    """Answers the coordinator's requests with the package of one checkout."""

    def __init__(self) -> None:
        self.cycles: dict[str, Callable[[], object]] = {}
        self.rigs: dict[str, HandoffRig] = {}

    def hello(self) -> dict[str, Any]:
        from django.conf import settings

        import django_keel_lock

        stores = [s for s in STORES if _store_up(s, settings.DATABASES)]
        mine = [
            module.__file__
            for name, module in list(sys.modules.items())
            if name.split(".")[0] == "django_keel_lock" and getattr(module, "__file__", None)
        ]
        return {"package": django_keel_lock.__file__, "modules": mine, "stores": stores}

    def rate(self, store: str, seconds: float) -> float:
        if store not in self.cycles:
            self.cycles[store] = _new_handle_cycle(store)
        return rate(self.cycles[store], seconds)

    def handoffs(self, store: str, count: int) -> list[float]:
        if store not in self.rigs:
            from .bench_db import store_pair

            key = f"bench:compare:{uuid.uuid4().hex}"
            self.rigs[store] = HandoffRig(lambda: store_pair(store, key), thread=store == "memory")
        return self.rigs[store].run(count)


def _store_up(store: str, databases: dict[str, Any]) -> bool:
    if store == "redis":
        try:
            from .bench_redis import raw_client

            return bool(raw_client().ping())
        except Exception:
            return False
    return store in ("memory", "sqlite") or store.split("-")[0] in databases


def _new_handle_cycle(store: str) -> Callable[[], None]:
    from django_keel_lock import lock

    key = f"bench:compare:{uuid.uuid4().hex}"

    def cycle() -> None:
        with lock(key, store=store):
            pass

    return cycle


def serve() -> None:
    """The worker's loop: one JSON request a line on stdin, one answer a line on the real
    stdout (anything else printed goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from .common import setup_django

    setup_django()
    worker = Worker()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "stop":
            for rig in worker.rigs.values():
                rig.stop()
            answers.write("null\n")
            answers.flush()
            return
        try:
            reply = getattr(worker, op)(**request)
        except Exception as exc:  # one store's failure ends that store's table, not the run
            traceback.print_exc()
            reply = {"failed": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


# The coordinator -------------------------------------------------------------------------


def check_imports(side: Side, hello: dict[str, Any]) -> None:
    """Fails unless every module of the package the worker loaded is the checkout's."""
    stray = [path for path in hello["modules"] if not path.startswith(side.tree + os.sep)]
    if stray or not hello["modules"]:
        raise RuntimeError(f"{side.name} imported the package from elsewhere: {stray[:3]}")


def compare_store(sides: list[Side], store: str, args: argparse.Namespace) -> list[list[object]]:
    """A store's rows: cycles/s (a new handle each `with`) and handoff p50 / p90."""

    def rate_of(side: Side) -> Callable[[], float]:
        return lambda: float(side.ask(op="rate", store=store, seconds=args.seconds))

    def handoffs_of(side: Side) -> Callable[[], list[float]]:
        return lambda: list(side.ask(op="handoffs", store=store, count=args.handoffs))

    a, b = sides
    rates = alternate({s.label: rate_of(s) for s in sides}, args.rounds)
    rounds = alternate({s.label: handoffs_of(s) for s in sides}, args.rounds)
    pooled = {label: [ms for each in r for ms in each] for label, r in rounds.items()}
    p50s = {label: [statistics.median(each) for each in r] for label, r in rounds.items()}
    cycles = ratio_spread(rates[b.label], rates[a.label])
    handoff = ratio_spread(p50s[b.label], p50s[a.label])
    return [
        [
            "cycles/s, a new handle each `with`",
            statistics.median(rates[a.label]),
            statistics.median(rates[b.label]),
            cycles,
            verdict(cycles, higher_is_faster=True),
        ],
        [
            "handoff p50 ms",
            percentile(pooled[a.label], 50),
            percentile(pooled[b.label], 50),
            handoff,
            verdict(handoff, higher_is_faster=False),
        ],
        [
            "handoff p90 ms",
            percentile(pooled[a.label], 90),
            percentile(pooled[b.label], 90),
            "",
            "",
        ],
    ]


def instruction_rows(sides: list[Side], names: list[str]) -> list[list[object]]:
    a, b = (callgrind.instructions(names, tree=side.tree) for side in sides)
    return [
        [f"instructions per cycle, {name}", a[name], b[name], f"{b[name] / a[name]:.3f}", ""]
        for name in names
    ]


def main(argv: list[str] | None = None) -> None:
    parser = round_options(__doc__, rounds=30, handoffs=4)
    parser.add_argument("rev_a", nargs="?", help="the revision before (A)")
    parser.add_argument("rev_b", nargs="?", help="the revision after (B)")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--no-callgrind", action="store_true", help="no instruction counts")
    parser.add_argument("--keep", action="store_true", help="leave the worktrees in place")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return
    if not (args.rev_a and args.rev_b):
        parser.error("give two revisions, e.g. HEAD~3 HEAD (or one twice for the noise floor)")
    root = tempfile.mkdtemp(prefix="keel-compare-", dir="/tmp")
    sides: list[Side] = []
    try:
        sides = [Side("a", args.rev_a, root), Side("b", args.rev_b, root)]
        run(sides, args)
    finally:
        for side in sides:
            side.close(args.keep)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def run(sides: list[Side], args: argparse.Namespace) -> None:
    hellos = [side.ask(op="hello") for side in sides]
    for side, hello in zip(sides, hellos, strict=True):
        check_imports(side, hello)
        print(f"{side.name}: the package from {Path(hello['package']).parent}")
    up = set(hellos[0]["stores"]) & set(hellos[1]["stores"])
    stores = [s for s in args.stores.split(",") if s in up]
    print(
        f"{os.cpu_count()} CPUs; {args.rounds} alternating rounds of {args.seconds:g}s per "
        f"cycles/s and of {args.handoffs} handoffs per figure;\nB / A: the median of the "
        "rounds' ratios (their middle half; least-most); within noise unless more rounds "
        "fall on one side of 1.00 than chance allows (sign test, p < 0.001)"
    )
    headers = ["figure", sides[0].name, sides[1].name, "B / A", ""]
    slower: list[str] = []
    for store in stores:
        try:
            rows = compare_store(sides, store, args)
        except Failed as exc:
            print(f"\n{store}: not compared, {exc}")
            slower.append(f"{store}: not compared")
            continue
        slower += [f"{store}, {row[0]}: {row[3]}" for row in rows if row[4] == "B slower"]
        if store == "memory" and not args.no_callgrind and callgrind.available():
            try:
                rows += instruction_rows(sides, CYCLES[:2])
            except subprocess.CalledProcessError as exc:
                print(f"\ninstructions not counted: {exc}\n{exc.stderr.decode()[-2000:]}")
        print(f"\n{store}")
        print_table(headers, rows)
    print("\nB slower than A beyond the noise:", "; ".join(slower) if slower else "nowhere")


if __name__ == "__main__":
    main()
