"""CI's two passes split the long runs between them (the chaos runs, the multi-key transfers):
they test the stores under load and faults, which the interpreter does not change.

KEEL_CHAOS_SHARD=i/n keeps every n-th run, starting at the i-th (CI's two passes take 1/2 and
2/2: each run once); the others run in the other pass, so they are not collected here at all.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

SHARD = os.environ.get("KEEL_CHAOS_SHARD", "1/1")


def in_shard(runs: list[Any]) -> list[Any]:
    """The runs of `runs` in this pass's KEEL_CHAOS_SHARD."""
    number, _, count = SHARD.partition("/")
    if not (number.isdigit() and count.isdigit() and 1 <= int(number) <= int(count)):
        raise pytest.UsageError(f"KEEL_CHAOS_SHARD must be i/n with 1 <= i <= n, not {SHARD!r}")
    return runs[int(number) - 1 :: int(count)]
