"""The chaos run (bench/chaos/): its checker, fed hand-made histories that break each rule,
and a short run per store with a fixed seed (marked `chaos`).

The runs take KEEL_CHAOS_SECONDS per store (default 60; 0 skips them) with
KEEL_CHAOS_WORKERS workers (default 8); KEEL_CHAOS_SHARD=i/n runs only every n-th store's,
starting at the i-th (CI's two passes take 1/2 and 2/2: each store once; tests/support/shard.py).
A broken rule fails with the seed and the history excerpt that shows it:
`python -m bench.chaos --store S --seed N` replays the same faults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from bench.chaos.checker import LIVENESS_MARGIN, Report, check

from .conftest import needs
from .support import ROOT
from .support.etcd import etcd_installed
from .support.redis_servers import REDIS_SERVER
from .support.shard import in_shard

CONFIG: dict[str, Any] = {
    "ttl": 2.0,
    "keys": [
        {"key": "k", "limit": None, "auto_extend": False},
        {"key": "s", "limit": 2, "auto_extend": False},
    ],
}


class Story:
    """A history written by hand, in the records' own format (bench/chaos/workers.py)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.audit: list[dict[str, Any]] = []
        self.calls = 0

    def call(
        self,
        worker: str,
        sid: str,
        op: str,
        start: float,
        end: float | None,
        outcome: str = "",
        budget: float = 10.0,
        exc: str = "",
        key: str = "",
    ) -> None:
        self.calls += 1
        cid = f"{worker}.c{self.calls}"
        self.records.append(
            {
                "key": key,
                "ev": "call",
                "w": worker,
                "cid": cid,
                "op": op,
                "sid": sid,
                "t": start,
                "budget": budget,
            }
        )
        if end is not None:
            self.records.append(
                {"ev": "ret", "w": worker, "cid": cid, "t": end, "outcome": outcome, "exc": exc}
            )

    def section(
        self,
        worker: str,
        sid: str,
        key: str,
        fence: int,
        start: float,
        end: float | None,
        told: bool = False,
        write: bool = True,
    ) -> None:
        """acquire, claim, write, release: the section runs from `start` to `end`."""
        self.call(worker, sid, "acquire", start - 0.1, start, "acquired", key=key)
        self.records.append(
            {"ev": "enter", "w": worker, "sid": sid, "key": key, "fence": fence, "t": start}
        )
        if write:
            self.call(worker, sid, "claim", start, start + 0.01, "accepted")
            self.accept(key, fence, sid, "claim")
        if end is None:
            return
        if write:
            self.call(worker, sid, "write", end - 0.02, end - 0.01, "accepted")
            self.accept(key, fence, sid, "write")
        self.records.append({"ev": "exit", "w": worker, "sid": sid, "t": end})
        self.call(worker, sid, "release", end, end + 0.01, "not_released" if told else "released")

    def accept(
        self, key: str, fence: int, writer: str, step: str, value: int | None = None
    ) -> None:
        last = next((r["value"] for r in reversed(self.audit) if r["key"] == key), 0)
        if value is None:
            value = last + 1 if step == "write" else last
        self.audit.append(
            {
                "id": len(self.audit) + 1,
                "key": key,
                "fence": fence,
                "value": value,
                "writer": writer,
                "step": step,
            }
        )

    def fault(self, kind: str, **info: Any) -> None:
        self.records.append({"ev": "fault", "kind": kind, **info})

    def check(self) -> Report:
        return check(self.records, self.audit, CONFIG)


def broken(report: Report) -> dict[int, list[str]]:
    rules: dict[int, list[str]] = {}
    for violation in report.violations:
        rules.setdefault(violation.rule, []).append(violation.what)
    return rules


def test_checker_passes_holders_that_take_turns() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 2.0)
    story.section("w2", "w2.s1", "k", 2, 2.1, 3.0)
    story.section("w1", "w1.s2", "s", 3, 1.0, 3.0)
    story.section("w2", "w2.s2", "s", 4, 1.5, 2.5, write=False)  # two permits of limit 2
    report = story.check()
    assert broken(report) == {}
    assert (report.sections, report.accepted, report.lost_notices) == (4, 6, 0)


def test_checker_reports_two_holders_of_one_key_at_once() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 3.0, write=False)
    story.section("w2", "w2.s1", "k", 2, 2.0, 4.0)
    assert list(broken(story.check())) == [1]


def test_checker_excuses_an_overlap_whose_holder_was_told_its_lock_was_lost() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 3.0, told=True, write=False)
    story.section("w2", "w2.s1", "k", 2, 2.0, 4.0)
    report = story.check()
    assert broken(report) == {}
    assert (report.excused_overlaps, report.lost_notices) == (1, 1)


def test_checker_ends_a_section_when_its_ttl_runs_out_by_its_holders_clock() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 4.0, write=False)  # its ttl (2 s) ran out at 2.9
    story.section("w2", "w2.s1", "k", 2, 3.0, 3.5)
    assert broken(story.check()) == {}


def test_checker_counts_a_confirmed_extend_in_the_holders_ttl() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 4.0, write=False)
    story.call("w1", "w1.s1", "extend", 2.5, 2.6, "extended")  # held until 4.5 now
    story.section("w2", "w2.s1", "k", 2, 3.0, 3.5)
    assert list(broken(story.check())) == [1]


def test_checker_reports_a_semaphore_with_more_holders_than_its_limit() -> None:
    story = Story()
    for n in range(3):
        story.section(f"w{n}", f"w{n}.s1", "s", n + 1, 1.0 + n / 10, 3.0, write=False)
    assert "3 holders of 's' (limit 2)" in broken(story.check())[1][0]


def test_checker_reports_a_fence_lower_than_one_the_resource_accepted() -> None:
    story = Story()
    story.section("w1", "w1.s1", "s", 5, 1.0, 2.0, write=False)
    story.section("w2", "w2.s1", "s", 4, 1.05, 2.0, write=False)  # began before w1 had it
    for worker, fence in (("w1", 5), ("w2", 4)):
        story.call(worker, f"{worker}.s1", "claim", 1.5, 1.6, "accepted")
        story.accept("s", fence, f"{worker}.s1", "claim")
    assert broken(story.check()) == {2: ["'s' accepted fence 4 after 5"]}


def test_checker_reports_a_fence_that_did_not_grow() -> None:
    story = Story()
    story.section("w1", "w1.s1", "s", 7, 1.0, 2.0, write=False)
    story.section("w2", "w2.s1", "s", 7, 1.5, 2.5, write=False)  # two permits, one fence
    assert broken(story.check()) == {
        2: ["'s': w2.s1 got fence 7, not above 7 of w1.s1, which had it before"]
    }


def test_checker_reports_a_write_the_holder_was_told_was_accepted_but_the_resource_lacks() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 2.0)
    story.audit.pop()  # the write
    assert "the resource has no such write" in broken(story.check())[2][0]


def test_checker_reports_an_accepted_write_between_two_of_another_holder() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, None)  # claims, then stalls
    story.section("w2", "w2.s1", "k", 2, 3.5, 4.0)
    story.call("w1", "w1.s1", "write", 4.5, 4.6, "accepted")  # a fence check that let it in
    story.accept("k", 2, "w1.s1", "write")
    story.records.append({"ev": "exit", "w": "w1", "sid": "w1.s1", "t": 4.7})
    story.call("w1", "w1.s1", "release", 4.7, 4.8, "not_released")
    assert broken(story.check())[3] == ["'k': w1.s1 wrote again after w2.s1 had"]


def test_checker_reports_a_lost_update() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, 2.0)
    story.section("w2", "w2.s1", "k", 2, 2.1, 3.0)
    story.audit[-1]["value"] = 1  # w2 wrote the value it read before w1's write
    assert "expected 2 (a lost update)" in broken(story.check())[3][0]


def test_checker_reports_a_call_that_outlasted_its_budget() -> None:
    story = Story()
    story.call("w1", "w1.s1", "acquire", 1.0, 9.0, "not_acquired", budget=5.0)
    report = story.check()
    assert broken(report) == {5: ["acquire w1.c1 took 8.00s, budget 5.00s (not_acquired)"]}
    assert report.overrun == pytest.approx(8.0)


def test_checker_reports_a_call_that_never_returned() -> None:
    story = Story()
    story.call("w1", "w1.s1", "release", 1.0, None)
    assert broken(story.check()) == {5: ["release w1.c1 never returned"]}


def test_checker_does_not_count_the_time_a_worker_was_stopped() -> None:
    story = Story()
    story.call("w1", "w1.s1", "acquire", 1.0, 9.0, "not_acquired", budget=5.0)
    story.fault("pause", t0=2.0, t1=6.0, victim="w1", stopped=2.0, resumed=6.0)
    assert broken(story.check()) == {}


def test_checker_reads_a_call_cut_by_a_kill_as_ended_by_it() -> None:
    story = Story()
    story.call("w1", "w1.s1", "acquire", 1.0, None, budget=5.0)
    story.fault("kill", t0=50.0, t1=50.1, victim="w1", dead_at=50.0)
    assert broken(story.check()) == {}


def test_checker_reports_an_unexpected_exception() -> None:
    story = Story()
    story.call("w1", "w1.s1", "acquire", 1.0, 1.1, "error", exc="builtins.KeyError: 'o'")
    assert broken(story.check()) == {5: ["acquire w1.c1 ended with builtins.KeyError: 'o'"]}


def test_checker_reports_a_worker_that_crashed() -> None:
    story = Story()
    story.fault("crash", victim="w1", rc=1, dead_at=3.0, stderr="Traceback ... boom")
    assert "worker w1 exited with 1" in broken(story.check())[5][0]


def test_checker_reports_a_key_not_taken_again_in_time_after_its_holder_died() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, None)
    story.fault("kill", t0=1.5, t1=1.6, victim="w1", dead_at=1.5)
    late = 1.5 + CONFIG["ttl"] + LIVENESS_MARGIN + 1
    story.call("w3", "w3.s1", "acquire", late - 0.6, late - 0.5, "not_acquired", key="k")
    story.section("w2", "w2.s1", "k", 2, late, late + 0.5)
    report = story.check()
    assert list(broken(report)) == [4]
    assert report.max_takeover == pytest.approx(late - 1.5)


def test_checker_does_not_judge_liveness_where_nobody_asked_for_the_key() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, None)
    story.fault("kill", t0=1.5, t1=1.6, victim="w1", dead_at=1.5)
    story.call("w3", "w3.s1", "acquire", 2.0, 2.1, "not_acquired", key="k")  # within its ttl
    assert broken(story.check()) == {}


def test_checker_allows_store_faults_the_time_they_kept_the_key_from_being_taken() -> None:
    story = Story()
    story.section("w1", "w1.s1", "k", 1, 1.0, None)
    story.fault("kill", t0=1.5, t1=1.6, victim="w1", dead_at=1.5)
    story.fault("server_restart", t0=2.0, t1=4.0)
    late = 1.5 + CONFIG["ttl"] + LIVENESS_MARGIN + 1
    story.call("w3", "w3.s1", "acquire", late - 0.6, late - 0.5, "not_acquired", key="k")
    story.section("w2", "w2.s1", "k", 2, late, late + 0.5)
    assert broken(story.check()) == {}


# -- the runs ---------------------------------------------------------------------------

SECONDS = float(os.environ.get("KEEL_CHAOS_SECONDS", "60"))
WORKERS = int(os.environ.get("KEEL_CHAOS_WORKERS", "8"))
SEED = 1
HAS_REDIS = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
HAS_POSTGRES = needs(settings.SERVERS["postgres"], "PostgreSQL (the fenced resource)")
HAS_MARIADB = needs(settings.SERVERS["mariadb"], "MariaDB")
HAS_ETCD = needs(etcd_installed(), "etcd (Debian's etcd-server)")
STORES = [
    pytest.param("memory", marks=[HAS_POSTGRES]),
    pytest.param("sqlite", marks=[HAS_POSTGRES]),
    pytest.param("postgres", marks=[HAS_POSTGRES]),
    pytest.param("postgres-fast", marks=[HAS_POSTGRES]),
    pytest.param("mariadb", marks=[HAS_POSTGRES, HAS_MARIADB]),
    pytest.param("redis", marks=[HAS_POSTGRES, HAS_REDIS]),
    pytest.param("redis-cluster", marks=[HAS_POSTGRES, HAS_REDIS]),
    pytest.param("redis-sentinel", marks=[HAS_POSTGRES, HAS_REDIS]),
    pytest.param("etcd", marks=[HAS_POSTGRES, HAS_ETCD]),
]


@pytest.mark.chaos
@pytest.mark.timeout(SECONDS * 2 + 240)
@pytest.mark.skipif(SECONDS <= 0, reason="KEEL_CHAOS_SECONDS=0 turns the chaos runs off")
@pytest.mark.parametrize("store", in_shard(STORES))
def test_chaos_run_breaks_no_rule(store: str, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--store",
            store,
            f"--seconds={SECONDS}",
            f"--seed={SEED}",
            f"--workers={WORKERS}",
            f"--summary={summary}",
        ],
        cwd=ROOT,
        env=dict(env, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=SECONDS * 2 + 200,
    )
    if not summary.exists() or not summary.read_text():
        pytest.fail(
            f"the chaos run did not finish ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    result = json.loads(summary.read_text())
    if result["violations"]:
        lines = [f"store {store}, seed {SEED}, {SECONDS:g}s, {WORKERS} workers:"]
        for violation in result["violations"][:5]:
            lines.append(f"rule {violation['rule']}: {violation['what']}")
            lines.extend(f"    {json.dumps(line)}" for line in violation["excerpt"])
        pytest.fail("\n".join(lines))
    assert result["row"][3] > 0, "the run recorded no operations"
