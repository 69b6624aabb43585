"""A process that takes random overlapping sets of keys with `LockStore.acquire_many` and does
a fenced write for each key it holds (tests/test_database_multi.py).

    python -m tests.support.many_child --store postgres --keys a,b,c,d --dir D --rounds 30

For each set it holds it writes, for each key, the file D/<index of the key> as "fence
count": it reads the file, checks that its fence is greater than the one written there, waits
a moment (so a second holder would overlap it), and writes its fence and count + 1. Two
holders of a key at once lose an increment or write a fence out of order. Prints one JSON
line: the sets it held per key (`taken`) and the fenced writes that found a fence not below
theirs (`violations`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path

from .child import setup_django


def fenced_write(path: Path, fence: int) -> bool:
    """Write `fence` and one more to the count in `path`; False if `path` had a fence not
    below `fence` (another holder's, later than ours)."""
    last, count = (int(part) for part in path.read_text().split())
    time.sleep(0.002)
    path.write_text(f"{max(last, fence)} {count + 1}")
    return fence > last


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--keys", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setup_django()
    from django_keel_lock import get_lock_store

    store = get_lock_store(args.store)
    keys = args.keys.split(",")
    chooser = random.Random(args.seed)
    taken, violations = [0] * len(keys), 0
    for _ in range(args.rounds):
        chosen = sorted(chooser.sample(range(len(keys)), chooser.randint(2, 3)))
        names = tuple(keys[i] for i in chosen)
        owner = uuid.uuid4().hex
        result = store.acquire_many(names, owner, "many-child", 30)
        if result.fences is None:
            time.sleep(0.005)
            continue
        for index, fence in zip(chosen, result.fences, strict=True):
            violations += not fenced_write(Path(args.dir, str(index)), fence)
            taken[index] += 1
        store.release_many(names, owner)
    print(json.dumps({"taken": taken, "violations": violations}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
