"""Leader election (`django_keel_lock.election`): candidates in processes of their own on
every store shared between processes, and the API in this process on the memory store."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from django_keel_lock import LockNotHeldError, LockUnavailable, election, get_lock_store
from django_keel_lock.leaders import KEY_PREFIX
from tests.conftest import needs_store, store_params
from tests.support import ROOT
from tests.support.commands import notes_of, wait_for
from tests.support.holders import child_env

SHARED_STORES = store_params(["sqlite", "postgres", "mariadb", "redis"])


def candidate(
    alias: str,
    name: str,
    log: Path,
    *,
    ttl: float = 2,
    hold: float | None = None,
    end: str = "",
    thread: bool = False,
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.support.candidate", "--store", alias, "--name", name,
            "--ttl", str(ttl), "--log", str(log)]  # fmt: skip
    if hold is not None:
        argv += ["--hold", str(hold)]
    if end:
        argv += ["--end", end]
    if thread:
        argv += ["--thread"]
    return subprocess.Popen(argv, cwd=ROOT, env=child_env())


def events(log: Path, what: str) -> list[tuple[int, int, float]]:
    """(term, pid, wall time) of each `what` line of a candidates' log, in order."""
    rows = [line.split() for line in notes_of(log)]
    return [(int(term), int(pid), float(at)) for kind, term, pid, at in rows if kind == what]


@pytest.mark.parametrize("alias", SHARED_STORES)
def test_one_leader_at_a_time_among_five_processes_and_terms_increase(
    alias: str, key: str, tmp_path: Path
) -> None:
    log = tmp_path / "log"
    procs = [candidate(alias, key, log, hold=0.1) for _ in range(5)]
    try:
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            proc.kill()
    elected, resigned = events(log, "elected"), events(log, "resign")
    assert len(elected) == len(resigned) == 5
    assert len({pid for _, pid, _ in elected}) == 5  # each led once
    terms = [term for term, _, _ in elected]
    assert terms == sorted(set(terms))  # strictly increasing, in the order they led
    # Each leader resigned before the next was elected (the log is in wall-clock order
    # within a machine; the resign line is written before the release).
    for (term, _, _), (next_term, _, elected_at) in itertools.pairwise(elected):
        resign_at = next(at for t, _, at in resigned if t == term)
        assert resign_at <= elected_at, (term, next_term)


@pytest.mark.parametrize("alias", SHARED_STORES)
def test_takeover_after_kill_9_sigterm_and_exit_seen_by_an_observer(
    alias: str, key: str, tmp_path: Path
) -> None:
    """kill -9: a candidate leads once the ttl runs out; SIGTERM and interpreter exit resign,
    so a candidate leads long before it would; current() from here shows each leader."""
    log, ttl = tmp_path / "log", 3.0
    observer = election(key, store=alias)
    first = candidate(alias, key, log, ttl=ttl)
    procs = [first]
    try:
        wait_for(lambda: events(log, "elected"), message="a leader")
        procs.append(candidate(alias, key, log, ttl=ttl, hold=1.0, end="exit"))
        wait_for(lambda: len(notes_of(log)) == 3, message="the candidate to campaign")
        leader = observer.current()
        assert leader is not None
        assert (leader.term, leader.holder) == (
            events(log, "elected")[0][0],
            f"candidate:{first.pid}",
        )
        assert leader.since is not None

        first.kill()
        killed_at = time.time()
        wait_for(lambda: len(events(log, "elected")) == 2, timeout=ttl + 10, message="takeover")
        term2, _, elected2 = events(log, "elected")[1]
        # It had to wait for the ttl: what was left of it (the watchdog renews every ttl / 3).
        assert elected2 - killed_at >= ttl * 2 / 3 - 0.5
        # The second leader exits after 1 s without resigning: exit resigns for it, and the
        # third leads at once (waiting in the line, or taking the lock free when it comes).
        procs.append(candidate(alias, key, log, ttl=ttl))
        wait_for(lambda: len(events(log, "elected")) == 3, timeout=ttl + 10, message="takeover")
        term3, pid3, elected3 = events(log, "elected")[2]
        exited_at = events(log, "resign")[0][2]
        assert elected3 - exited_at < ttl - 1.0, "interpreter exit did not resign"
        current = observer.current()
        assert current is not None and (current.term, current.holder) == (
            term3,
            f"candidate:{pid3}",
        )
        assert events(log, "elected")[0][0] < term2 < term3

        third = next(proc for proc in procs if proc.pid == pid3)
        third.send_signal(signal.SIGTERM)
        assert third.wait(10) == -signal.SIGTERM  # it still dies of SIGTERM, resigned first
        wait_for(lambda: observer.current() is None, timeout=ttl - 1.0, message="no leader")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@needs_store("redis")
def test_interpreter_exit_resigns_a_leader_elected_from_another_thread(
    key: str, tmp_path: Path
) -> None:
    log, ttl = tmp_path / "log", 5.0
    first = candidate("redis", key, log, ttl=ttl, hold=0.2, end="exit", thread=True)
    procs = [first]
    try:
        wait_for(lambda: events(log, "elected"), message="a leader")
        procs.append(candidate("redis", key, log, ttl=ttl))
        assert first.wait(10) == 0
        wait_for(lambda: len(events(log, "elected")) == 2, timeout=ttl + 5, message="takeover")
        exited_at = events(log, "resign")[0][2]
        assert events(log, "elected")[1][2] - exited_at < ttl - 2.0, "exit did not resign"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- the API, in this process (memory store) ---------------------------------------------
def test_campaign_resign_is_leader_and_current(key: str) -> None:
    elected: list[int] = []
    one = election(key, ttl=5, store="memory", holder="one:1", on_elected=elected.append)
    two = election(key, ttl=5, store="memory", holder="two:2")
    assert one.current() is None and not one.is_leader() and one.term is None
    term = one.campaign()
    assert elected == [term] and one.is_leader() and one.campaign() == term
    assert two.current() == one.current()
    found = two.current()
    assert found is not None and (found.holder, found.term) == ("one:1", term)
    with pytest.raises(LockUnavailable, match=r"not elected within 0\.1"):
        two.campaign(timeout=0.1)
    assert one.resign() and not one.is_leader() and not one.resign()
    assert two.current() is None  # the only leader resigned: nobody leads
    assert two.campaign(timeout=0.1) > term
    assert two.resign()
    assert one.key == f"{KEY_PREFIX}{key}"


def test_a_candidate_takes_over_when_the_leader_resigns(key: str) -> None:
    import threading

    leader = election(key, ttl=30, store="memory")
    other = election(key, ttl=30, store="memory")
    terms: list[int] = []
    leader.campaign()
    waiting = threading.Thread(target=lambda: terms.append(other.campaign()))
    waiting.start()
    time.sleep(0.1)
    assert not terms
    leader.resign()
    waiting.join(5)
    assert terms and terms[0] > (leader.term or 0) and other.is_leader()
    other.resign()


def test_a_with_block_is_told_through_on_lost_and_raises_on_leaving(key: str) -> None:
    lost: list[int] = []
    leader = election(key, ttl=0.6, store="memory", on_lost=lost.append)
    with pytest.raises(LockNotHeldError), leader as term:
        get_lock_store("memory").force_release(leader.key)
        wait_for(lambda: lost, timeout=5, message="on_lost")
        assert not leader.is_leader()
    assert lost == [term]


def test_an_async_with_body_is_cancelled_when_leadership_is_lost(key: str) -> None:
    lost: list[int] = []
    leader = election(key, ttl=0.6, store="memory", on_lost=lost.append)

    async def lead() -> str:
        async with leader as term:
            assert await leader.acurrent() is not None
            get_lock_store("memory").force_release(leader.key)
            await asyncio.sleep(10)  # cancelled at the next renewal
            return f"ran {term}"
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(LockNotHeldError):
        asyncio.run(lead())
    assert time.monotonic() - started < 5
    assert lost == [leader.term]


def test_acampaign_and_aresign(key: str) -> None:
    async def go() -> tuple[int, bool, bool]:
        leader = election(key, ttl=5, store="memory")
        term = await leader.acampaign(timeout=1)
        return term, leader.is_leader(), await leader.aresign()

    term, leading, resigned = asyncio.run(go())
    assert term > 0 and leading and resigned


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="ttl"):
        election("x", ttl=-1, store="memory")
    with pytest.raises(ValueError, match="key is"):
        election("x" * 300, store="sqlite")
