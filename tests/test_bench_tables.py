"""The bench's arithmetic: contenders taking turns, ratios taken round by round with their
spread, the side-by-side rows, and instructions per cycle from callgrind's dumps."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.callgrind import per_cycle, read_dumps, segments
from bench.common import (
    Contender,
    Measured,
    Spread,
    alternate,
    compared_rows,
    paired,
    ratio_spread,
    sign_test,
    verdict,
)


def test_alternate_gives_each_contender_every_round_in_turns_reversing_each_round():
    calls: list[str] = []

    def measure(name: str):
        def run() -> int:
            calls.append(name)
            return len(calls)

        return run

    results = alternate({"a": measure("a"), "b": measure("b"), "c": measure("c")}, rounds=3)

    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert results == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}


def test_ratio_spread_is_the_median_of_round_by_round_ratios_not_the_ratio_of_medians():
    ours, theirs = [10.0, 30.0, 21.0, 8.0, 4.0], [10.0, 10.0, 7.0, 2.0, 8.0]  # 10 / 8 = 1.25

    spread = ratio_spread(ours, theirs)  # ratios 1, 3, 3, 4, 0.5

    assert spread == Spread(median=3.0, q1=1.0, q3=3.0, low=0.5, high=4.0, above=3, below=1)
    assert str(spread) == "3.00 (1.00-3.00; 0.50-4.00)"
    assert ratio_spread([3.0], [2.0]) == Spread(1.5, 1.5, 1.5, 1.5, 1.5, above=1)


def test_ratio_spread_refuses_rounds_that_do_not_pair_up():
    with pytest.raises(ValueError, match="as many rounds on each side, got 2 and 3"):
        ratio_spread([1.0, 2.0], [1.0, 2.0, 3.0])


def test_sign_test_is_the_binomial_two_sided_p_value():
    assert sign_test(2, 2) == 1.0
    assert sign_test(4, 0) == 2 / 16
    assert sign_test(0, 4) == 2 / 16
    assert sign_test(21, 9) == pytest.approx(0.0428, abs=1e-4)
    assert sign_test(20, 10) == pytest.approx(0.0987, abs=1e-4)
    assert sign_test(23, 7) == pytest.approx(0.0052, abs=1e-4)
    assert sign_test(0, 0) == 1.0


def test_verdict_tells_only_when_the_rounds_agree_more_often_than_chance():
    def rounds(above: int, below: int, median: float) -> Spread:
        return Spread(median, median, median, median, median, above, below)

    assert verdict(rounds(10, 0, 1.2), higher_is_faster=True) == "within noise"  # 10 never tell
    assert verdict(rounds(24, 6, 1.2), higher_is_faster=True) == "within noise"  # p = 0.0014
    assert verdict(rounds(25, 5, 1.05), higher_is_faster=True) == "B faster"  # p = 0.0003
    assert verdict(rounds(25, 5, 1.05), higher_is_faster=False) == "B slower"
    assert verdict(rounds(3, 27, 0.9), higher_is_faster=False) == "B faster"


def test_compared_rows_set_each_peer_against_the_row_of_ours_it_names():
    contenders = [
        Contender("keel-lock postgres"),
        Contender("keel-lock postgres-fast"),
        Contender("recipe", ours="keel-lock postgres"),
        Contender("advisory", ours="keel-lock postgres-fast"),
    ]
    results = {
        "keel-lock postgres": Measured([100.0, 300.0], [[2.0, 4.0], [6.0]]),
        "keel-lock postgres-fast": Measured([400.0, 400.0], [[1.0], [1.0]]),
        "recipe": Measured([50.0, 100.0], []),
        "advisory": Measured([800.0, 500.0], [[0.5], [0.25]]),
    }

    rows = compared_rows(contenders, results)

    assert rows[0][:5] == ["keel-lock postgres", 200.0, 4.0, 6.0, ""]
    assert rows[2][:5] == ["recipe", 75.0, "-", "-", "keel-lock postgres"]
    assert (rows[2][5].median, rows[2][5].low, rows[2][5].high) == (2.5, 2.0, 3.0)
    assert rows[2][6] == "-"  # the recipe has no handoff
    cycles, handoffs = rows[3][5], rows[3][6]
    assert (cycles.median, cycles.low, cycles.high) == (0.65, 0.5, 0.8)
    assert (handoffs.median, handoffs.low, handoffs.high) == (3.0, 2.0, 4.0)


def test_paired_puts_each_peer_right_after_the_row_of_ours_it_faces():
    contenders = [
        Contender("ours a"),
        Contender("ours b"),
        Contender("peer of b", ours="ours b"),
        Contender("peer of a", ours="ours a"),
        Contender("peer of nobody here", ours="ours c"),
    ]

    names = [c.name for c in paired(contenders)]

    assert names == ["ours a", "peer of a", "ours b", "peer of b", "peer of nobody here"]


def test_segments_add_each_markers_dumps_to_the_run_before_it():
    # Three markers, each dumping twice (a big dump: the run before it; a small: the marker).
    assert segments([1000, 3, 50, 3, 70, 3], markers=3) == [1003, 53, 73]
    with pytest.raises(ValueError, match="5 dumps are not an equal number for each of 3"):
        segments([1, 2, 3, 4, 5], markers=3)


def test_per_cycle_subtracts_the_shorter_run_and_divides_by_the_extra_cycles():
    # start-up, then per cycle: base run, base + extra run
    segs = [10**9, 58_000_000 + 7, 58_000_000 * 6 + 7, 40_000_000, 40_000_000 * 6]

    assert per_cycle(segs, ["new", "reused"], extra=5000) == {"new": 58_000.0, "reused": 40_000.0}
    with pytest.raises(ValueError, match="expected 3 segments, got 5"):
        per_cycle(segs, ["new"], extra=5000)


def test_read_dumps_orders_numbered_dumps_by_number_and_leaves_out_the_final_one(tmp_path: Path):
    for name, count in [("cg.1", 5), ("cg.2", 7), ("cg.10", 11), ("cg", 99)]:
        (tmp_path / name).write_text(
            f"version: 1\ncmd: python\nsummary: {count}\ntotals: {count}\n"
        )
    for number in range(3, 10):
        (tmp_path / f"cg.{number}").write_text(f"summary: {number * 100}\n")

    assert read_dumps(str(tmp_path), "cg") == [5, 7, *[n * 100 for n in range(3, 10)], 11]
