"""Run the chaos test against one or more stores and print a table per store.

    python -m bench.chaos --store redis --seconds 600 --seed 1 --workers 16 [--out history.jsonl]

Each store runs in a process of its own (Django is set up once per process, with that store's
settings): workers, nemesis and checker, then a row of the table. Exit status 1 if any rule
was broken; the violations are printed with the seed and the history excerpt that shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import print_table

from .checker import RULES, Report, check, excerpt
from .stores import SOCKET_TIMEOUT, TARGETS

HEADERS = (
    "store",
    "seconds",
    "workers",
    "operations",
    "sections",
    "faults",
    "rule 1",
    "rule 2",
    "rule 3",
    "rule 4",
    "rule 5",
    "told overlaps",
    "lost notices",
    "calls unavailable",
    "writes accepted/refused",
    "max takeover (s)",
    "max past timeout (s)",
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--store", default="memory", help=f"comma-separated, or all: {', '.join(TARGETS)}"
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--ttl", type=float, default=2.0, help="every lock's ttl, seconds")
    parser.add_argument(
        "--interval", type=float, default=2.0, help="mean seconds between two faults"
    )
    parser.add_argument(
        "--out",
        help="the raw history, JSON lines (one file per store: "
        "the store's name is added before the suffix when there are several)",
    )
    parser.add_argument(
        "--check",
        metavar="HISTORY",
        help="check a history that --out wrote again (after a change to the checker)",
    )
    parser.add_argument("--summary", help=argparse.SUPPRESS)  # one store's row, for the parent
    args = parser.parse_args(argv)
    if args.check:
        return recheck(args.check)
    names = list(TARGETS) if args.store == "all" else args.store.split(",")
    for name in names:
        if name not in TARGETS:
            parser.error(f"--store: unknown store {name!r} (known: {', '.join(TARGETS)}, all)")
    for option in ("seconds", "workers", "ttl", "interval"):
        if getattr(args, option) <= 0:
            parser.error(f"--{option} must be > 0, got {getattr(args, option)}")
    if args.summary:
        return run_one(names[0], args)
    rows, failed = [], False
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            summary = handle.name
        out = _out_path(args.out, name, len(names))
        command = [
            sys.executable,
            "-m",
            "bench.chaos",
            "--store",
            name,
            "--summary",
            summary,
            *(
                f"--{o}={getattr(args, o)}"
                for o in ("seconds", "seed", "workers", "ttl", "interval")
            ),
        ]
        if out:
            command.append(f"--out={out}")
        done = subprocess.run(command)
        try:
            result = json.loads(Path(summary).read_text() or "{}")
        finally:
            os.remove(summary)
        if not result:
            print(f"{name}: the run failed (exit status {done.returncode})", file=sys.stderr)
            failed = True
            continue
        rows.append(result["row"])
        failed |= bool(result["violations"])
    if rows:
        print_table(HEADERS, rows)
    return 1 if failed else 0


def _out_path(out: str | None, name: str, count: int) -> str | None:
    if not out or count == 1:
        return out
    path = Path(out)
    return str(path.with_name(f"{path.stem}-{name}{path.suffix}"))


def run_one(name: str, args: argparse.Namespace) -> int:
    """One store: start it, run workers and nemesis for `args.seconds`, check, summarise."""
    run = f"{os.getpid()}-{args.seed}"
    folder = Path(tempfile.mkdtemp(prefix=f"keel-chaos-{name}-"))
    target = TARGETS[name](run)
    try:
        settings = target.open()
        keys: list[dict[str, Any]] = [
            {"key": f"chaos.{run}.{kind}", "limit": limit, "auto_extend": auto}
            for kind, limit, auto in (
                ("lock", None, False),
                ("lock-extended", None, True),
                ("semaphore", 2, False),
                ("semaphore-extended", 2, True),
            )
            if target.modes or limit is None
        ]
        config: dict[str, Any] = {
            **settings,
            "keys": keys,
            "ttl": args.ttl,
            "socket_timeout": SOCKET_TIMEOUT,
            "until": 0,
        }
        os.environ["KEEL_CHAOS_CONFIG"] = json.dumps(config)
        os.environ["DJANGO_SETTINGS_MODULE"] = "bench.chaos.settings"
        _prepare([spec["key"] for spec in keys])
        report, records, audit = _run(target, config, args, folder)
    finally:
        target.close()
    row = _row(name, args.seconds, args.workers, report)
    if not args.summary:
        print_table(HEADERS, [row])
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items()))
    print(f"{name}: calls by outcome: {outcomes}")
    violations = _violations(name, args.seed, report, records, audit)
    if args.out:
        with open(args.out, "w") as handle:
            head = {"ev": "run", "store": name, "keys": config["keys"], "ttl": args.ttl}
            head.update(seed=args.seed, seconds=args.seconds, workers=args.workers)
            handle.write(json.dumps(head) + "\n")
            for record in sorted(
                records + [dict(r, ev="audit") for r in audit],
                key=lambda r: r.get("t", r.get("t0", 0)),
            ):
                handle.write(json.dumps(record) + "\n")
    # The per-worker files stay for a broken run without --out (nothing else has them).
    if violations and not args.out:
        print(f"{name}: history in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
        if args.out:
            print(f"{name}: history in {args.out}")
    if args.summary:
        Path(args.summary).write_text(json.dumps({"row": row, "violations": violations}))
    return 1 if violations else 0


def _violations(
    name: str, seed: int, report: Report, records: list[dict[str, Any]], audit: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Print each violation with the seed and its history excerpt; the same as JSON."""
    violations = []
    for violation in report.violations:
        lines = excerpt(violation, records, audit)
        violations.append({"rule": violation.rule, "what": violation.what, "excerpt": lines})
        print(f"\nrule {violation.rule} broken (store {name}, seed {seed}): {violation.what}")
        for line in lines:
            print("   ", json.dumps(line))
    return violations


def recheck(path: str) -> int:
    """The checker again over a history written by --out."""
    with open(path) as handle:
        lines = [json.loads(line) for line in handle]
    run = next(line for line in lines if line["ev"] == "run")
    audit = [line for line in lines if line["ev"] == "audit"]
    records = [line for line in lines if line["ev"] not in ("run", "audit")]
    report = check(records, audit, run)
    print_table(HEADERS, [_row(run["store"], run["seconds"], run.get("workers", 0), report)])
    return 1 if _violations(run["store"], run["seed"], report, records, audit) else 0


def _prepare(keys: list[str]) -> None:
    """Django up, the store's tables migrated, the resource's rows ready (value 0, fence 0)."""
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
        for key in keys:
            cursor.execute("INSERT INTO keel_chaos_resource (key) VALUES (%s)", [key])
    connections.close_all()


def _run(
    target: Any, config: dict[str, Any], args: argparse.Namespace, folder: Path
) -> tuple[Report, list[dict[str, Any]], list[dict[str, Any]]]:
    from django.db import connections

    from .nemesis import FaultLog, Processes, Threads, run_nemesis

    log = FaultLog(folder / "nemesis.jsonl")
    config["until"] = time.monotonic() + args.seconds
    pool_class = Threads if target.threads else Processes
    pool = pool_class(folder, config, args.seed, log)
    for _ in range(args.workers):
        pool.spawn()
    rng = random.Random(args.seed)
    # The last faults land a ttl before the end: the checker sees what followed them.
    run_nemesis(pool, target.faults, rng, config["until"] - 2 * args.ttl, args.interval, log)
    pool.finish(grace=4 * args.ttl + 3 * SOCKET_TIMEOUT + 15)
    records: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path) as handle:
            records.extend(json.loads(line) for line in handle if line.endswith("\n"))
    keys = [spec["key"] for spec in config["keys"]]
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT id, key, fence, value, writer, step FROM keel_chaos_audit "
            "WHERE key = ANY(%s) ORDER BY id",
            [keys],
        )
        columns = [c[0] for c in cursor.description]
        audit = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    return check(records, audit, config), records, audit


def _row(name: str, seconds: float, workers: int, report: Report) -> list[object]:
    faults = " ".join(f"{kind}={count}" for kind, count in sorted(report.faults.items()))
    takeover = report.max_takeover
    return [
        name,
        f"{seconds:g}",
        workers,
        report.operations,
        report.sections,
        faults,
        *(report.count(rule) for rule in RULES),
        report.excused_overlaps,
        report.lost_notices,
        sum(n for kind, n in report.outcomes.items() if kind.endswith(":unavailable")),
        f"{report.accepted}/{report.refused}",
        "-" if takeover is None else f"{takeover:.2f}",
        f"{report.overrun:.2f}",
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
