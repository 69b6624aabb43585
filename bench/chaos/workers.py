"""A chaos worker: takes locks on the run's keys in a loop, writes the fenced resource inside
each critical section, and records every call and section to a JSON-lines file of its own.

Each line is flushed as it is written, so a SIGKILL loses at most the call in progress: the
checker reads a call with a start and no end as open until the process died.

    python -m bench.chaos.workers WORKER_ID HISTORY_FILE SEED     (config: KEEL_CHAOS_CONFIG)
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: What a call may take beyond its own timeout, in store round trips (SOCKET_TIMEOUT each: a
#: database call on a connection found dead is retried once on a new one) plus a margin for a
#: machine shared with other work. The checker calls a call that outlasts this a hang.
ROUND_TRIPS = 3
MARGIN = 5.0


class History:
    """One worker's record: a JSON object a line, flushed at once."""

    def __init__(self, path: str, worker: str) -> None:
        self.worker = worker
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the worker's life
        self._mutex = threading.Lock()  # the watchdog's on_lost writes from its own thread
        self._calls = 0

    def log(self, **record: Any) -> None:
        record["w"] = self.worker
        line = json.dumps(record)
        with self._mutex:
            self._file.write(line + "\n")
            self._file.flush()

    def call(
        self, op: str, sid: str, budget: float, fn: Callable[[], Any], **extra: Any
    ) -> tuple[str, Any]:
        """Run `fn`, recording its start (with `extra`), end, outcome and any exception."""
        from django_keel_lock import LockNotHeldError, LockStoreUnavailable

        self._calls += 1
        cid = f"{self.worker}.c{self._calls}"
        self.log(ev="call", cid=cid, op=op, sid=sid, t=time.monotonic(), budget=budget, **extra)
        result: Any = None
        exc = ""
        try:
            result = fn()
            outcome = OUTCOMES[op](result)
        except LockStoreUnavailable as error:  # why, for the reader of the history
            outcome, exc = "unavailable", f"{type(error).__name__}: {str(error)[:300]}"
        except LockNotHeldError as error:
            outcome, exc = "not_held", type(error).__name__
        except Exception as error:  # what rule 5 looks for: recorded, never raised on
            outcome, exc = "error", f"{type(error).__module__}.{type(error).__name__}: {error}"
        self.log(ev="ret", cid=cid, t=time.monotonic(), outcome=outcome, exc=exc)
        return outcome, result


OUTCOMES: dict[str, Callable[[Any], str]] = {
    "acquire": lambda r: "acquired" if r else "not_acquired",
    "release": lambda r: "released" if r else "not_released",
    "extend": lambda r: "extended",
    "claim": lambda r: "accepted" if r == 1 else "refused",
    "write": lambda r: "accepted" if r == 1 else "refused",
    "read": lambda r: "read",
}


def work(
    history: History,
    config: dict[str, Any],
    rng: random.Random,
    nap: Callable[[float], None],
    stopping: Callable[[], bool],
) -> None:
    """Take a lock on a random key, claim and write the resource under it, release; again."""
    sections = 0
    while not stopping():
        sections += 1
        section(
            history, config, rng.choice(config["keys"]), f"{history.worker}.s{sections}", rng, nap
        )


def section(
    history: History,
    config: dict[str, Any],
    spec: dict[str, Any],
    sid: str,
    rng: random.Random,
    nap: Callable[[float], None],
) -> None:
    """One attempt at a critical section `sid` on the key of `spec`: acquire (waiting or not);
    if acquired, claim the resource with the fence, read it, work around the ttl (some
    sections extend midway), write the value back plus one, release."""
    from django_keel_lock import lock, semaphore
    from django_keel_lock.fencing import fenced_update

    from .models import Resource

    ttl, round_trip = config["ttl"], config["socket_timeout"] * ROUND_TRIPS + MARGIN
    key = spec["key"]

    def on_lost(handle: Any) -> None:
        history.log(ev="lost", sid=sid, t=time.monotonic())

    options: dict[str, Any] = {
        "ttl": ttl,
        "auto_extend": spec["auto_extend"],
        "on_lost": on_lost,
        "holder": sid,
    }
    if spec["limit"]:
        handle = semaphore(key, limit=spec["limit"], **options)
    else:
        handle = lock(key, **options)
    timeout = 0.0 if rng.random() < 0.3 else rng.uniform(0.1, 2 * ttl)
    outcome, _ = history.call(
        "acquire",
        sid,
        timeout + round_trip,
        lambda: handle.acquire(timeout=timeout),
        key=key,
        timeout=timeout,
    )
    if outcome != "acquired":
        nap(rng.uniform(0.05, 0.3))
        return
    fence = handle.fence
    assert fence is not None  # acquired: the handle has its fence
    history.log(ev="enter", sid=sid, key=key, fence=fence, t=time.monotonic())
    rows = Resource.objects.filter(key=key)
    history.call(
        "claim", sid, 30, lambda: fenced_update(rows, fence=fence, writer=sid, step="claim")
    )
    _, value = history.call("read", sid, 30, lambda: rows.values_list("value", flat=True).get())
    # Around the ttl: some sections outlast it and lose their lock (those with auto_extend
    # keep it, unless a fault stops the renewals).
    work_for = rng.uniform(0.2, 1.5) * ttl
    if not spec["auto_extend"] and rng.random() < 0.3:
        nap(work_for / 2)
        history.call("extend", sid, round_trip, handle.extend)
        nap(work_for / 2)
    else:
        nap(work_for)
    if isinstance(value, int):
        history.call(
            "write",
            sid,
            30,
            lambda: fenced_update(rows, fence=fence, writer=sid, step="write", value=value + 1),
        )
    history.log(ev="exit", sid=sid, t=time.monotonic())
    history.call("release", sid, round_trip, handle.release)
    history.log(ev="done", sid=sid, t=time.monotonic(), lost=handle.lost)


def main(argv: list[str]) -> int:
    worker, path, seed = argv
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.chaos.settings")
    import django

    django.setup()
    config = json.loads(os.environ["KEEL_CHAOS_CONFIG"])
    history = History(path, worker)
    history.log(ev="start", pid=os.getpid(), t=time.monotonic())
    work(
        history, config, random.Random(seed), time.sleep, lambda: time.monotonic() > config["until"]
    )
    history.log(ev="stop", t=time.monotonic())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
