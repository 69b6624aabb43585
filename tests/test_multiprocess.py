"""Mutual exclusion across real processes, per store that spans processes."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import time
from pathlib import Path

import pytest

from django_keel_lock import lock

from .conftest import STORE_AVAILABILITY, store_params

PROCESSES = 8
ROUNDS = 20
CROSS_PROCESS_STORES = [alias for alias in STORE_AVAILABILITY if alias != "memory"]


def _worker(alias: str, key: str, counter: Path, out: Path) -> None:
    """Increment a file counter non-atomically (read, sleep, write) under the lock."""
    sections = []
    for _ in range(ROUNDS):
        handle = lock(key, ttl=30, store=alias)
        assert handle.acquire(timeout=60, retry_delay=0.01), "waited 60 s for the lock"
        start = time.monotonic()
        value = int(counter.read_text())
        time.sleep(0.002)  # widen the race window: without the lock, increments get lost
        counter.write_text(str(value + 1))
        end = time.monotonic()
        sections.append((start, end, handle.fence))
        assert handle.release()
    out.write_text(json.dumps(sections))


@pytest.mark.parametrize("alias", store_params(CROSS_PROCESS_STORES))
def test_many_processes_never_overlap_and_counter_is_exact(
    alias: str, key: str, tmp_path: Path
) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    context = multiprocessing.get_context("fork")
    procs = [
        context.Process(target=_worker, args=(alias, key, counter, tmp_path / f"{i}.json"))
        for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(180)
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES

    assert int(counter.read_text()) == PROCESSES * ROUNDS
    sections = sorted(
        tuple(section)
        for i in range(PROCESSES)
        for section in json.loads((tmp_path / f"{i}.json").read_text())
    )
    assert len(sections) == PROCESSES * ROUNDS
    for (_, end, fence), (start, _, next_fence) in itertools.pairwise(sections):
        assert end <= start, "two critical sections overlapped"
        assert next_fence > fence, "fences must grow in the order the lock was held"
    assert lock(key, store=alias).run(lambda: "after") == (True, "after")
