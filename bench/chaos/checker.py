"""The checker: reads a chaos run's whole history and reports what broke each rule.

The history is the workers' records (`workers.py`: call/ret of every call, enter/exit of every
critical section, lost notices), the nemesis' faults, and the fenced resource's audit (every
write PostgreSQL accepted, in the order it accepted them). All times are CLOCK_MONOTONIC,
one clock for every process on the machine.

1. Sections of one key never overlap (a semaphore of limit n: never more than n at once) unless
   one of them was told its lock was lost: `lost` (on_lost), `release()` False, or
   LockNotHeldError. A section is held from its acquire's return until its release starts,
   its process dies, or its ttl runs out by its own clock (ttl after its acquire, or after its
   last extend, began; with auto_extend the watchdog says when it is lost): what its holder
   may believe. One whose holder was paused and then killed before it could be told is
   excused too (it never acted on the lock again).
2. Per key, the resource never accepted a fence lower than one it had accepted; and it
   accepted exactly the writes the workers were told it accepted. Fences grow: an
   acquisition that began after another had returned got a greater fence.
3. The accepted writes of each holder are contiguous in the resource's order (no other
   holder's accepted write between two of one holder's), and no update was lost (each write is
   the previous value plus one). This is the overlap the resource itself can see: a stale
   holder's write that lands before the new holder's first write is ordered before it, harmless.
4. Liveness, exclusive keys: after a holder was killed, no acquire of the key was refused
   later than ttl + `LIVENESS_MARGIN` after the kill (or after the end of the sections that
   held it then), plus the time store faults overlapped that window, before the key was
   taken again. The takeover delay is from then to the next acquisition.
5. Every call ended as acquired, not acquired, LockStoreUnavailable or LockNotHeldError (or
   its process died), within its budget (timeout + round trips, time stopped by SIGSTOP not
   counted); no other exception, no worker that crashed.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: How long after a dead holder's ttl ran out its key may stay unacquired (rule 4): a waiter's
#: poll interval, a few round trips and a busy machine's scheduling delays.
LIVENESS_MARGIN = 3.0
RULES = (1, 2, 3, 4, 5)
TOLD_LOST = frozenset({"not_held", "not_released"})
DEFINED = frozenset(
    {
        "acquired",
        "not_acquired",
        "released",
        "not_released",
        "extended",
        "unavailable",
        "not_held",
        "accepted",
        "refused",
        "read",
    }
)
#: Faults that may keep a key from being taken (rule 4's allowance): everything but the
#: workers' own deaths and pauses.
WORKER_FAULTS = frozenset({"kill", "pause", "end_kill", "crash"})


@dataclass
class Violation:
    rule: int
    what: str
    sids: tuple[str, ...] = ()
    at: float = 0.0


@dataclass
class Section:
    sid: str
    worker: str
    key: str
    fence: int
    start: float
    end: float | None = None
    died: bool = False
    told: bool = False
    paused: bool = False
    #: When its ttl runs out by its holder's clock, without auto_extend (inf: with it).
    valid_until: float = float("inf")

    @property
    def held_until(self) -> float:
        """The end of the time its holder may believe it holds the lock (inf: still open)."""
        return min(float("inf") if self.end is None else self.end, self.valid_until)

    @property
    def excused(self) -> bool:
        return self.told or (self.died and self.paused)


@dataclass
class Report:
    operations: int = 0
    sections: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    excused_overlaps: int = 0
    lost_notices: int = 0
    accepted: int = 0
    refused: int = 0
    takeovers: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    #: The longest a call took past its own timeout (0 for calls without one), seconds.
    overrun: float = 0.0

    def count(self, rule: int) -> int:
        return sum(1 for v in self.violations if v.rule == rule)

    @property
    def max_takeover(self) -> float | None:
        return max(self.takeovers) if self.takeovers else None


def check(
    records: Iterable[dict[str, Any]], audit: list[dict[str, Any]], config: dict[str, Any]
) -> Report:
    """Everything the history breaks. `records`: the workers' and the nemesis' lines;
    `audit`: the resource's accepted writes (key, fence, value, writer, step) by id;
    `config`: the run's (keys with their limit, ttl)."""
    report = Report()
    calls: dict[str, dict[str, Any]] = {}
    returns: dict[str, dict[str, Any]] = {}
    sections: dict[str, Section] = {}
    told: set[str] = set()
    deaths: dict[str, tuple[float, str]] = {}
    pauses: dict[str, list[tuple[float, float]]] = defaultdict(list)
    outages: list[tuple[float, float]] = []
    for record in records:
        ev = record.get("ev")
        if ev == "fault":
            _fault(record, report, deaths, pauses, outages)
        elif ev == "call":
            calls[record["cid"]] = record
        elif ev == "ret":
            returns[record["cid"]] = record
        elif ev == "enter":
            sections[record["sid"]] = Section(
                record["sid"], record["w"], record["key"], record["fence"], record["t"]
            )
        elif ev == "exit" and record["sid"] in sections:
            sections[record["sid"]].end = record["t"]
        elif ev == "lost" or (ev == "done" and record.get("lost")):
            told.add(record["sid"])
    for cid, ret in returns.items():
        call = calls.get(cid)
        if call is not None and ret["outcome"] in TOLD_LOST:
            told.add(call["sid"])
    report.lost_notices = sum(1 for sid in told if sid in sections)
    _validity(sections, calls, returns, config)
    for section in sections.values():
        section.told = section.sid in told
        if section.end is None and section.worker in deaths:
            section.end, section.died = deaths[section.worker][0], True
        section.paused = any(
            a < (section.end or float("inf")) and b > section.start
            for a, b in pauses.get(section.worker, ())
        )
    report.sections = len(sections)
    limits = {spec["key"]: spec["limit"] or 1 for spec in config["keys"]}
    _overlaps(sections, limits, report)
    _resource(audit, calls, returns, deaths, report)
    _fences_grow(sections, calls, report)
    refusals: dict[str, list[float]] = defaultdict(list)
    for cid, call in calls.items():
        back = returns.get(cid)
        if call["op"] == "acquire" and back is not None and back["outcome"] == "not_acquired":
            refusals[call.get("key", "")].append(back["t"])
    _liveness(sections, config, deaths, outages, refusals, report)
    _calls(calls, returns, deaths, pauses, report)
    return report


def _fault(
    record: dict[str, Any],
    report: Report,
    deaths: dict[str, tuple[float, str]],
    pauses: dict[str, list[tuple[float, float]]],
    outages: list[tuple[float, float]],
) -> None:
    kind = record["kind"]
    if kind != "end_kill":
        report.faults[kind] += 1
    if kind in ("kill", "end_kill", "crash"):
        deaths[record["victim"]] = (record["dead_at"], kind)
    if kind == "crash":
        report.violations.append(
            Violation(
                5,
                f"worker {record['victim']} exited with {record.get('rc')}: "
                f"{record.get('stderr', '')[-300:]}",
                at=record["dead_at"],
            )
        )
    if kind == "pause":
        pauses[record["victim"]].append((record["stopped"], record["resumed"]))
    if kind not in WORKER_FAULTS:
        outages.append((record["t0"], record["t1"]))


def _validity(
    sections: dict[str, Section],
    calls: dict[str, dict[str, Any]],
    returns: dict[str, dict[str, Any]],
    config: dict[str, Any],
) -> None:
    """Each section's `valid_until`: a ttl after its acquire began, or after the last
    extend that returned "extended" began (sections of auto_extend keys: no limit)."""
    auto = {spec["key"] for spec in config["keys"] if spec["auto_extend"]}
    for cid, call in calls.items():
        section = sections.get(call["sid"])
        if section is None or section.key in auto:
            continue
        ret = returns.get(cid)
        granted = call["op"] == "acquire" or (
            call["op"] == "extend" and ret is not None and ret["outcome"] == "extended"
        )
        if granted:
            until = call["t"] + config["ttl"]
            if section.valid_until == float("inf") or until > section.valid_until:
                section.valid_until = until


def _overlaps(sections: dict[str, Section], limits: dict[str, int], report: Report) -> None:
    """Rule 1: at no moment more holders of a key than its limit, unless one was told."""
    by_key: dict[str, list[Section]] = defaultdict(list)
    for section in sections.values():
        by_key[section.key].append(section)
    for key, group in by_key.items():
        limit = limits.get(key, 1)
        active: list[Section] = []
        for section in sorted(group, key=lambda s: s.start):
            active = [a for a in active if a.held_until > section.start]
            active.append(section)
            if len(active) <= limit:
                continue
            if any(a.excused for a in active):
                report.excused_overlaps += 1
            else:
                sids = tuple(a.sid for a in active)
                report.violations.append(
                    Violation(
                        1,
                        f"{len(active)} holders of {key!r} (limit {limit}) at once: "
                        f"fences {[a.fence for a in active]}",
                        sids,
                        section.start,
                    )
                )


def _resource(
    audit: list[dict[str, Any]],
    calls: dict[str, dict[str, Any]],
    returns: dict[str, dict[str, Any]],
    deaths: dict[str, tuple[float, str]],
    report: Report,
) -> None:
    """Rules 2 and 3, over the resource's own order of accepted writes."""
    told_accepted: set[tuple[str, str]] = set()
    in_flight: set[tuple[str, str]] = set()
    for cid, call in calls.items():
        if call["op"] not in ("claim", "write"):
            continue
        ret = returns.get(cid)
        if ret is None:
            in_flight.add((call["sid"], call["op"]))
        elif ret["outcome"] == "accepted":
            told_accepted.add((call["sid"], call["op"]))
            report.accepted += 1
        elif ret["outcome"] == "refused":
            report.refused += 1
    seen: set[tuple[str, str]] = set()
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(audit, key=lambda r: r["id"]):
        by_key[row["key"]].append(row)
        seen.add((row["writer"], row["step"]))
    for sid, step in sorted(seen - told_accepted - in_flight):
        report.violations.append(
            Violation(
                2, f"the resource accepted {step} of {sid} but its holder was not told so", (sid,)
            )
        )
    for sid, step in sorted(told_accepted - seen):
        report.violations.append(
            Violation(
                2, f"{sid} was told its {step} was accepted; the resource has no such write", (sid,)
            )
        )
    for key, rows in by_key.items():
        highest, value, writer = 0, 0, ""
        done: set[str] = set()
        for row in rows:
            if row["fence"] < highest:
                report.violations.append(
                    Violation(
                        2,
                        f"{key!r} accepted fence {row['fence']} after {highest}",
                        (row["writer"],),
                    )
                )
            highest = max(highest, row["fence"])
            if row["writer"] != writer:
                if row["writer"] in done:
                    report.violations.append(
                        Violation(
                            3,
                            f"{key!r}: {row['writer']} wrote again after {writer} had",
                            (row["writer"], writer),
                        )
                    )
                done.add(writer)
                writer = row["writer"]
            expected = value + 1 if row["step"] == "write" else value
            if row["value"] != expected:
                report.violations.append(
                    Violation(
                        3,
                        f"{key!r}: {row['step']} of {row['writer']} left {row['value']}, "
                        f"expected {expected} (a lost update)",
                        (row["writer"],),
                    )
                )
            value = row["value"]


def _fences_grow(
    sections: dict[str, Section], calls: dict[str, dict[str, Any]], report: Report
) -> None:
    """Rule 2: a fence greater than every fence handed out before the acquire began."""
    began = {c["sid"]: c["t"] for c in calls.values() if c["op"] == "acquire"}
    by_key: dict[str, list[Section]] = defaultdict(list)
    for section in sections.values():
        by_key[section.key].append(section)
    for key, group in by_key.items():
        earlier = sorted(group, key=lambda s: s.start)
        at, highest, holder = 0, 0, ""
        for section in sorted(group, key=lambda s: began.get(s.sid, s.start)):
            start = began.get(section.sid, section.start)
            while at < len(earlier) and earlier[at].start < start:
                if earlier[at].fence > highest:
                    highest, holder = earlier[at].fence, earlier[at].sid
                at += 1
            if section.fence <= highest:
                report.violations.append(
                    Violation(
                        2,
                        f"{key!r}: {section.sid} got fence {section.fence}, not above "
                        f"{highest} of {holder}, which had it before",
                        (section.sid, holder),
                        section.start,
                    )
                )


def _liveness(
    sections: dict[str, Section],
    config: dict[str, Any],
    deaths: dict[str, tuple[float, str]],
    outages: list[tuple[float, float]],
    refusals: dict[str, list[float]],
    report: Report,
) -> None:
    """Rule 4, exclusive keys: a key whose holder was killed is taken again in time, or at
    least nobody was refused it past that time (nobody may have asked)."""
    exclusive = {spec["key"] for spec in config["keys"] if not spec["limit"]}
    by_key: dict[str, list[Section]] = defaultdict(list)
    for section in sections.values():
        by_key[section.key].append(section)
    for group in by_key.values():
        group.sort(key=lambda s: s.start)
    for dead in sections.values():
        if not dead.died or dead.key not in exclusive or deaths[dead.worker][1] != "kill":
            continue
        killed = deaths[dead.worker][0]
        group = by_key[dead.key]
        # Holders that had it meanwhile (the dead one's lock may have expired already).
        others = [s for s in group if s is not dead and s.start <= killed and s.held_until > killed]
        free = max([killed, *(s.held_until for s in others)])
        if free == float("inf"):
            continue  # another holder never let go: rule 1 and 5 say why
        allowed = config["ttl"] + LIVENESS_MARGIN
        allowed += sum(max(0.0, min(b, free + allowed) - max(a, free)) for a, b in outages)
        after = bisect.bisect_right([s.start for s in group], free)
        nxt = group[after].start if after < len(group) else float("inf")
        if nxt < float("inf"):
            report.takeovers.append(nxt - free)
        refused = [t for t in refusals.get(dead.key, ()) if free + allowed < t < nxt]
        if refused:
            late = "never taken again" if nxt == float("inf") else f"taken {nxt - free:.2f}s"
            report.violations.append(
                Violation(
                    4,
                    f"{dead.key!r} {late} after {dead.sid} died, refused "
                    f"{refused[0] - free:.2f}s after (allowed {allowed:.2f}s)",
                    (dead.sid,),
                    killed,
                )
            )


def _calls(
    calls: dict[str, dict[str, Any]],
    returns: dict[str, dict[str, Any]],
    deaths: dict[str, tuple[float, str]],
    pauses: dict[str, list[tuple[float, float]]],
    report: Report,
) -> None:
    """Rule 5: every call ended in a defined way, within its budget."""
    report.operations = len(calls)
    for cid, call in calls.items():
        ret = returns.get(cid)
        death = deaths.get(call["w"])
        if ret is not None:
            ended, outcome = ret["t"], ret["outcome"]
        elif death is not None and death[0] >= call["t"]:
            ended, outcome = death[0], "died"
        else:
            report.violations.append(
                Violation(5, f"{call['op']} {cid} never returned", (call["sid"],), call["t"])
            )
            continue
        report.outcomes[f"{call['op']}:{outcome}"] += 1
        stopped = sum(
            max(0.0, min(b, ended) - max(a, call["t"])) for a, b in pauses.get(call["w"], ())
        )
        took = ended - call["t"] - stopped
        if outcome != "died":
            report.overrun = max(report.overrun, took - call.get("timeout", 0.0))
        if outcome == "died" and death is not None and death[1] == "kill":
            continue  # killed mid-call by the nemesis: that is how it ended
        if took > call["budget"]:
            report.violations.append(
                Violation(
                    5,
                    f"{call['op']} {cid} took {took:.2f}s, budget {call['budget']:.2f}s"
                    f" ({outcome})",
                    (call["sid"],),
                    call["t"],
                )
            )
        if outcome not in DEFINED and outcome != "died":
            report.violations.append(
                Violation(
                    5,
                    f"{call['op']} {cid} ended with {ret and ret.get('exc')}",
                    (call["sid"],),
                    call["t"],
                )
            )


def excerpt(
    violation: Violation,
    records: list[dict[str, Any]],
    audit: list[dict[str, Any]],
    limit: int = 40,
) -> list[dict[str, Any]]:
    """The records that show `violation`: its sections' and calls' lines, the audit rows of
    its writers, and the faults within a few seconds of it."""
    sids = set(violation.sids)
    cids = {r["cid"] for r in records if r.get("ev") == "call" and r.get("sid") in sids}
    picked = [
        r
        for r in records
        if r.get("sid") in sids
        or r.get("cid") in cids
        or (r.get("ev") == "fault" and abs(r.get("t0", 0) - violation.at) < 5)
    ]
    picked.sort(key=lambda r: r.get("t", r.get("t0", 0)))
    rows = [dict(r, ev="audit") for r in audit if r["writer"] in sids]
    return (picked + rows)[-limit:]
