"""Instructions per cycle of the core's CPU-bound paths (the memory store), counted by
valgrind's callgrind: the same count whatever else the machine is doing, where cycles/s move
with the load.

One process under callgrind runs, for each cycle, `--base` cycles and then `--base + --extra`
cycles, calling `os.getppid()` (a marker: callgrind dumps its counts on entering it) around
each run. A cycle's figure is (count of the longer run - count of the shorter) / extra: the
start-up, the first calls' warm-up and the markers' own cost cancel out.

    .venv/bin/python -m bench.callgrind [--base 1000] [--extra 5000]

With `--database ALIAS` (a store of bench/settings.py: postgres, postgres-fast, mariadb,
sqlite), the cycles are that database store's instead, on the bench databases (KEEL_BENCH_DB):
its own acquire and release (`store.acquire` + `store.release`) and a handle's
(`with lock(key)`). The count is this process's only: the client's Python and driver, not
the server's work.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from .bench_core import CYCLES, core_cycles

#: Callgrind dumps its counts on entering any function this matches (Python's os_getppid and
#: libc's getppid: a marker may dump more than once, always the same number of times).
MARKER = "*getppid*"
#: Runs the named bench module with the package imported from the checkout `tree` and the
#: bench from `repo`: argv = tree repo module args...
BOOT = (
    "import sys; tree, repo, module = sys.argv[1:4]; sys.path.insert(0, tree); "
    "import django_keel_lock; sys.path.insert(0, repo); import runpy; "
    "sys.argv = [module, *sys.argv[4:]]; runpy.run_module(module, run_name='__main__')"
)
REPO = str(Path(__file__).resolve().parent.parent)


def segments(parts: Sequence[int], markers: int) -> list[int]:
    """The instructions between one marker and the next (the first: before the first marker),
    from the counts of the dumps the markers made, in order (the program's end not among
    them). Each marker dumps the same number of times; the dumps after a marker's first are
    the marker's own few instructions and count with the segment before it."""
    if markers < 1 or len(parts) % markers:
        raise ValueError(
            f"{len(parts)} dumps are not an equal number for each of {markers} markers"
        )
    each = len(parts) // markers
    return [sum(parts[index : index + each]) for index in range(0, len(parts), each)]


def per_cycle(segs: Sequence[int], names: Sequence[str], extra: int) -> dict[str, float]:
    """Instructions per cycle of each named cycle, from segments laid out as the child runs
    them: start-up, then per cycle its base run and its base + extra run."""
    if len(segs) != 1 + 2 * len(names):
        raise ValueError(f"expected {1 + 2 * len(names)} segments, got {len(segs)}")
    return {
        name: (segs[2 + 2 * index] - segs[1 + 2 * index]) / extra
        for index, name in enumerate(names)
    }


def read_dumps(directory: str, stem: str) -> list[int]:
    """The instruction counts of callgrind's numbered dumps `stem.1`, `stem.2`, ... in order."""
    found = []
    for path in Path(directory).glob(f"{stem}.*"):
        if path.suffix[1:].isdigit():
            text = path.read_text()
            match = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
            if match is None:
                raise ValueError(f"{path} has no summary line: not a callgrind dump?")
            found.append((int(path.suffix[1:]), int(match.group(1))))
    return [count for _, count in sorted(found)]


def available() -> bool:
    return shutil.which("valgrind") is not None


def instructions(
    names: Sequence[str],
    base: int = 1000,
    extra: int = 5000,
    tree: str | None = None,
    database: str | None = None,
) -> dict[str, float]:
    """Instructions per cycle of each named cycle (CYCLES; DB_CYCLES of the store `database`),
    the package imported from the checkout `tree` (by default the one this process imported
    it from)."""
    if tree is None:
        import django_keel_lock

        tree = str(Path(django_keel_lock.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="keel-callgrind-") as out:
        command = ["valgrind", "--tool=callgrind", f"--dump-before={MARKER}"]
        command += [f"--callgrind-out-file={out}/cg", sys.executable, "-c", BOOT, tree, REPO]
        child = ["--child"] if database is None else ["--child-db", database]
        command += ["bench.callgrind", *child, str(base), str(extra), *names]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, env=env, cwd=out, capture_output=True)
        parts = read_dumps(out, "cg")
    return per_cycle(segments(parts, 1 + 2 * len(names)), names, extra)


def _child(base: int, extra: int, names: Sequence[str]) -> None:
    """Under callgrind: set Django up with the memory store alone, then run the cycles."""
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django_keel_lock"],
        KEEL_LOCK_STORES={"memory": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"}},
        USE_TZ=True,
    )
    django.setup()
    _markers(core_cycles("bench:callgrind"), base, extra, names)


def _child_db(alias: str, base: int, extra: int, names: Sequence[str]) -> None:
    """Under callgrind: set Django up with the bench settings, then run the store's cycles."""
    from .common import setup_django

    setup_django()
    _markers(db_cycles(alias, f"bench:callgrind:{uuid.uuid4().hex}"), base, extra, names)


#: The database store cycles `--database` counts (see `db_cycles`).
DB_CYCLES = ["store.acquire + store.release", "with lock(key)"]


def db_cycles(alias: str, key: str) -> dict[str, Callable[[], object]]:
    """One acquire+release of `key` on the store `alias`, each way of DB_CYCLES."""
    from django_keel_lock import lock
    from django_keel_lock.registry import get_lock_store

    store = get_lock_store(alias)

    def store_cycle() -> None:
        assert store.acquire(key, "callgrind", "callgrind", 30).acquired
        assert store.release(key, "callgrind")

    def handle_cycle() -> None:
        with lock(key, ttl=30, store=alias):
            pass

    return dict(zip(DB_CYCLES, [store_cycle, handle_cycle], strict=True))


def _markers(
    cycles: dict[str, Callable[[], object]], base: int, extra: int, names: Sequence[str]
) -> None:
    """Run each named cycle `base` times, then `base + extra` times, a marker around each."""
    os.getppid()
    for name in names:
        _repeat(cycles[name], base)
        os.getppid()
        _repeat(cycles[name], base + extra)
        os.getppid()


def _repeat(cycle: Callable[[], object], times: int) -> None:
    for _ in range(times):
        cycle()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--base", type=int, default=1000, help="cycles of the shorter run")
    parser.add_argument("--extra", type=int, default=5000, help="more cycles in the longer run")
    parser.add_argument("--database", help="a database store's alias: its cycles, not the core's")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--child-db", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), int(args.child[1]), args.child[2:])
        return
    if args.child_db:
        alias, base, extra, *names = args.child_db
        _child_db(alias, int(base), int(extra), names)
        return
    names = CYCLES if args.database is None else DB_CYCLES
    counts = instructions(names, args.base, args.extra, database=args.database)
    for name, count in counts.items():
        print(f"{name}: {count:,.0f} instructions per cycle")


if __name__ == "__main__":
    main()
