"""`manage.py locks lead NAME -- COMMAND`: every node runs the same line, the leader runs the
command, a candidate takes over when the leader dies, is stopped, or loses leadership."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from django_keel_lock import get_lock_store, lock
from django_keel_lock.leaders import KEY_PREFIX
from tests.conftest import needs_store, store_params
from tests.settings import REDIS_URL
from tests.support.commands import (
    alive,
    catches,
    child_command,
    notes_of,
    start_locks,
    wait_for,
)
from tests.support.redis_servers import FaultyProxy


def lead(alias: str, name: str, notes: Path, ttl: float) -> subprocess.Popen[str]:
    return start_locks("lead", name, "--store", alias, "--ttl", str(ttl), "--",
                       *child_command(notes, sleep=60, code=7, linger=0.2))  # fmt: skip


def started(path: Path) -> tuple[int, int]:
    """(pid, fence) of the command a node started last ((0, 0): none)."""
    lines = [line for line in notes_of(path) if line[0].isdigit()]
    if not lines:
        return 0, 0
    pid, fence, _ = lines[-1].split()
    return int(pid), int(fence)


def running(notes: list[Path]) -> list[int]:
    """The nodes whose last command runs (started, and neither ended nor killed)."""
    return [
        n
        for n, path in enumerate(notes)
        if started(path)[0] and notes_of(path)[-1] != "exit" and alive(started(path)[0])
    ]


@pytest.mark.parametrize("alias", store_params(["postgres", "redis"]))
def test_three_nodes_one_command_taken_over_after_kill_9_and_sigterm(
    alias: str, key: str, tmp_path: Path
) -> None:
    ttl = 2.0
    notes = [tmp_path / f"node{n}" for n in range(3)]
    nodes = [lead(alias, key, path, ttl) for path in notes]
    try:
        first = wait_for(lambda: running(notes), message="a leader's command")[0]  # type: ignore[index]
        time.sleep(0.5)
        assert running(notes) == [first]
        pid, fence = started(notes[first])

        nodes[first].kill()  # kill -9: its command dies with it; a candidate leads after the ttl
        wait_for(lambda: not alive(pid), timeout=5, message="the orphaned command to die")
        second = wait_for(lambda: running(notes), timeout=ttl + 10, message="takeover")[0]  # type: ignore[index]
        assert second != first and running(notes) == [second]
        _, fence2 = started(notes[second])
        assert fence2 > fence

        nodes[second].send_signal(signal.SIGTERM)  # passed on; the node resigns after it ends
        assert nodes[second].wait(10) == 7  # the command's status
        assert notes_of(notes[second])[-2:] == ["term", "exit"]
        stopped = time.monotonic()
        third = wait_for(lambda: running(notes), timeout=ttl, message="takeover on resign")[0]  # type: ignore[index]
        assert time.monotonic() - stopped < ttl  # it did not wait for the ttl
        assert third not in (first, second)
        assert started(notes[third])[1] > fence2
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    leader = get_lock_store(alias).get(f"{KEY_PREFIX}{key}")
    assert leader is None or leader.expires_in <= ttl


@needs_store("redis")
def test_a_leader_that_loses_leadership_stops_its_command_and_campaigns_again(
    key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "node"
    node = lead("redis", key, notes, ttl=1.5)
    try:
        wait_for(lambda: notes_of(notes), message="the command")
        _, fence = started(notes)
        get_lock_store("redis").force_release(f"{KEY_PREFIX}{key}")
        wait_for(lambda: "term" in notes_of(notes), timeout=10, message="the command stopped")
        wait_for(lambda: started(notes)[1] > fence, timeout=10, message="a new term")
        assert node.poll() is None
        node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=10)
        assert node.returncode == 7
        assert "campaigning again" in err
    finally:
        node.kill()
        node.wait()


@needs_store("redis")
def test_a_leader_cut_off_from_the_store_ends_its_command_before_its_term_can_expire(
    key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "node"
    proxy = FaultyProxy(int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]))
    node = start_locks("lead", key, "--store", "redis", "--ttl", "1.5", "--grace", "5", "--",
                       *child_command(notes, sleep=60, deaf=True),
                       env={"REDIS_URL": proxy.url})  # fmt: skip
    try:
        wait_for(lambda: notes_of(notes), message="the command")
        pid, _ = started(notes)
        proxy.mode = "stall"
        other = lock(f"{KEY_PREFIX}{key}", store="redis", ttl=5, holder="other-node:1")
        wait_for(other.acquire, timeout=10, message="the term to expire")
        assert not alive(pid), "the old term's command still ran when another node led"
        other.release()
    finally:
        proxy.close()
        node.kill()
        node.wait()


@needs_store("sqlite")
def test_a_candidate_stopped_by_sigterm_exits_0_and_runs_nothing(key: str, tmp_path: Path) -> None:
    leader_notes, candidate_notes = tmp_path / "leader", tmp_path / "candidate"
    leader = lead("sqlite", key, leader_notes, ttl=5)
    try:
        wait_for(lambda: notes_of(leader_notes), message="the leader's command")
        candidate = lead("sqlite", key, candidate_notes, ttl=5)
        # Campaigning: it took SIGTERM over (Python's default would kill it, exit -15).
        wait_for(lambda: catches(candidate.pid, signal.SIGTERM), message="the candidate")
        time.sleep(0.3)
        candidate.send_signal(signal.SIGTERM)
        assert candidate.wait(10) == 0
        assert not candidate_notes.exists()
    finally:
        leader.kill()
        leader.wait()
