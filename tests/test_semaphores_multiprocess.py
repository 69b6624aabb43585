"""Semaphores and shared locks across real processes, per store that spans processes.

Each process records when it held its permit (time.monotonic: one clock for every process of
the machine); a sweep over those intervals gives how many held it at once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from django_keel_lock import lock, semaphore

from .conftest import store_params

CROSS_PROCESS_STORES = store_params(["sqlite", "postgres", "mariadb", "redis"])
PROCESSES = 16
LIMIT = 3
ROUNDS = 4
#: How long a writer may wait behind a stream of readers that each hold for READ_HOLD: the
#: readers already in finish (one READ_HOLD), no new one comes in meanwhile; the rest is
#: room for a loaded machine.
WRITER_BOUND = 2.0
READ_HOLD = 0.03

FORK = multiprocessing.get_context("fork")


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at any moment (one ending as another starts: none)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    inside = peak = 0
    for _, step in events:
        inside += step
        peak = max(peak, inside)
    return peak


def _permit_worker(alias: str, key: str, out: Path) -> None:
    held = []
    for _ in range(ROUNDS):
        permit = semaphore(key, limit=LIMIT, ttl=30, store=alias)
        assert permit.acquire(timeout=120), "waited 120 s for a permit"
        start = time.monotonic()
        time.sleep(0.02)
        held.append((start, time.monotonic(), permit.fence))
        assert permit.release()
    out.write_text(json.dumps(held))


def _run(target: object, args_list: list[tuple[object, ...]], timeout: float = 240) -> None:
    procs = [FORK.Process(target=target, args=args) for args in args_list]  # type: ignore[arg-type]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)


@pytest.mark.parametrize("alias", CROSS_PROCESS_STORES)
def test_16_processes_on_a_limit_3_semaphore_never_exceed_3_and_reach_3(
    alias: str, key: str, tmp_path: Path
) -> None:
    _run(_permit_worker, [(alias, key, tmp_path / f"{i}.json") for i in range(PROCESSES)])
    held = [
        tuple(h) for i in range(PROCESSES) for h in json.loads((tmp_path / f"{i}.json").read_text())
    ]
    assert len(held) == PROCESSES * ROUNDS
    assert most_at_once([(start, end) for start, end, _ in held]) == LIMIT
    assert len({fence for _, _, fence in held}) == len(held), "two permits shared a fence"
    assert semaphore(key, limit=1, store=alias).run(lambda: "free again") == (True, "free again")


def _killed_holder(alias: str, key: str, ready: Path) -> None:
    permit = semaphore(key, limit=2, ttl=1.5, store=alias)
    assert permit.acquire()
    ready.write_text(str(permit.fence))
    time.sleep(60)  # SIGKILLed long before


@pytest.mark.parametrize("alias", CROSS_PROCESS_STORES)
def test_sigkilled_permit_holder_frees_its_permit_at_its_ttl_and_not_the_others(
    alias: str, key: str, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    child = FORK.Process(target=_killed_holder, args=(alias, key, ready))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and child.is_alive(), "the child never held it"
            time.sleep(0.01)
        mine = semaphore(key, limit=2, ttl=30, store=alias)
        assert mine.acquire()
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(10)
        killed_at = time.monotonic()
        third = semaphore(key, limit=2, ttl=30, store=alias)
        assert not third.acquire(), "the dead holder's permit was freed before its ttl"
        assert third.acquire(timeout=10)
        waited = time.monotonic() - killed_at
        assert waited < 5, f"the dead holder's permit was freed after {waited:.1f}s (ttl 1.5s)"
        assert mine.is_owned(), "another holder's permit went with the dead one's"
        assert {h.owner for h in mine.holders()} == {mine.owner, third.owner}
        assert mine.release() and third.release()
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def _reader(alias: str, key: str, until: float, out: Path) -> None:
    held = []
    while time.monotonic() < until:
        reader = lock(key, shared=True, ttl=30, store=alias)
        assert reader.acquire(timeout=30), "a reader waited 30 s"
        start = time.monotonic()
        time.sleep(READ_HOLD)
        held.append((start, time.monotonic()))
        assert reader.release()
    out.write_text(json.dumps(held))


def _writer(alias: str, key: str, start_at: float, out: Path) -> None:
    time.sleep(max(0.0, start_at - time.monotonic()))
    writer = lock(key, ttl=30, store=alias)
    asked = time.monotonic()
    got = writer.acquire(timeout=10)
    start = end = time.monotonic()
    if got:
        time.sleep(0.05)
        end = time.monotonic()  # before the release: a reader may come in right after it
        assert writer.release()
    out.write_text(json.dumps({"got": got, "asked": asked, "start": start, "end": end}))


@pytest.mark.parametrize("alias", CROSS_PROCESS_STORES)
def test_readers_overlap_a_writer_is_alone_and_gets_in_despite_a_stream_of_readers(
    alias: str, key: str, tmp_path: Path
) -> None:
    now = time.monotonic()
    readers = [(alias, key, now + 5, tmp_path / f"r{i}.json") for i in range(4)]
    procs = [FORK.Process(target=_reader, args=args) for args in readers]
    procs.append(FORK.Process(target=_writer, args=(alias, key, now + 1.5, tmp_path / "w.json")))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)

    reads = [tuple(h) for i in range(4) for h in json.loads((tmp_path / f"r{i}.json").read_text())]
    write = json.loads((tmp_path / "w.json").read_text())
    assert write["got"], "the writer never got the lock"
    waited = write["start"] - write["asked"]
    assert waited < WRITER_BOUND, f"the writer waited {waited:.2f}s behind the readers"
    assert most_at_once(reads) >= 2, "readers never held the lock together"  # type: ignore[arg-type]
    for start, end in reads:
        assert end <= write["start"] or start >= write["end"], "a reader overlapped the writer"
    assert any(start >= write["end"] for start, _ in reads), "readers did not come back after"
