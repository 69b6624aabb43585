"""Contention for tests/test_redis_multi.py: a worker takes random sets of keys with
`acquire_many` (or one key with `acquire`) and counts each key's turns on a plain Redis
counter with a read, a pause and a write: any overlap of two holders of a key loses a count.

Run as a child: `python -m tests.support.multi_worker URL ITERATIONS KEY...` prints one JSON
line, the worker's turns."""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

#: A turn: the keys taken and each one's fence.
Turn = tuple[tuple[str, ...], tuple[int, ...]]


def counter_name(key: str) -> str:
    return f"multi-test-count:{key}"


def take_turns(store: Any, raw: Any, keys: Sequence[str], iterations: int, size: int) -> list[Turn]:
    """`iterations` turns of `size` keys drawn from `keys` (one key: with `acquire`)."""
    owner, turns = uuid.uuid4().hex, []
    draw = random.Random()
    for _ in range(iterations):
        chosen = tuple(sorted(draw.sample(list(keys), size)))
        while True:
            if size == 1:
                single = store.acquire(chosen[0], owner, "worker", 30)
                fences = None if single.fence is None else (single.fence,)
            else:
                fences = store.acquire_many(chosen, owner, "worker", 30).fences
            if fences is not None:
                break
            time.sleep(0.0005)
        for key in chosen:
            value = int(raw.get(counter_name(key)) or 0)
            time.sleep(0.0005)
            raw.set(counter_name(key), value + 1)
        turns.append((chosen, fences))
        released = (
            store.release(chosen[0], owner) if size == 1 else store.release_many(chosen, owner)
        )
        assert released
    return turns


def main(argv: Sequence[str]) -> None:
    import django
    import redis

    django.setup()
    from django_keel_lock.stores import RedisLockStore

    url, iterations, keys = argv[0], int(argv[1]), argv[2:]
    store = RedisLockStore("multi-worker", {"URL": url})
    raw = redis.Redis.from_url(url)
    print("ready", flush=True)
    sys.stdin.readline()  # every worker starts at once
    turns = take_turns(store, raw, keys, iterations, 2)
    print(json.dumps(turns), flush=True)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
