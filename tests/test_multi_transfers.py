"""Money moved between accounts under multi-key locks, by real processes on every store.

8 processes (threads on the memory store, which lives in one process) move random amounts
between 5 accounts for DURATION seconds, each transfer under `lock([a, b])`. Each account is
a file holding its balance and the fence of its last write; a write carrying a fence no
greater than that one is refused and counted: two holders of one key overlapped. Half the
workers name each pair low key first, half high key first (ABBA): a lock that took its keys
one by one in the caller's order would deadlock them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from django_keel_lock import lock

from .conftest import STORE_AVAILABILITY, store_params
from .support.shard import in_shard

WORKERS = 8
ACCOUNTS = 5
START_BALANCE = 1_000
#: Seconds of transfers per store, as the issue asks (20 s of every store; CI's two passes
#: share the stores out: KEEL_CHAOS_SHARD).
DURATION = 20.0
#: Seconds a transfer may wait for its two accounts before the worker gives up (a deadlock
#: or starvation shows as a worker that fails, not as a test that hangs).
WAIT = 30.0


class Ledger:
    """The accounts, a file each: {"balance": int, "fence": int} written whole (os.replace),
    a write refused when its fence is not greater than the file's."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder = folder
        self.prefix = prefix

    def key(self, account: int) -> str:
        return f"{self.prefix}:{account}"

    def path(self, account: int) -> Path:
        return self.folder / f"account-{account}.json"

    def open(self) -> None:
        for account in range(ACCOUNTS):
            self.path(account).write_text(json.dumps({"balance": START_BALANCE, "fence": 0}))

    def read(self, account: int) -> dict[str, int]:
        data: dict[str, int] = json.loads(self.path(account).read_text())
        return data

    def write(self, account: int, balance: int, fence: int) -> bool:
        """Store `balance` if `fence` is newer than the last write's; False (refused) if not."""
        if fence <= self.read(account)["fence"]:
            return False
        scratch = self.folder / f".account-{account}.{os.getpid()}.{threading.get_ident()}"
        scratch.write_text(json.dumps({"balance": balance, "fence": fence}))
        os.replace(scratch, self.path(account))
        return True

    def total(self) -> int:
        return sum(self.read(account)["balance"] for account in range(ACCOUNTS))


def transfers(alias: str, ledger: Ledger, number: int, out: Path, until: float) -> None:
    """Move random amounts between two random accounts until `until` (time.time()); write
    how many transfers it made and how many writes were refused."""
    rng = random.Random(number)
    done = refused = 0
    while time.time() < until:
        low, high = sorted(rng.sample(range(ACCOUNTS), 2))
        pair = (low, high) if number % 2 else (high, low)  # half the workers ask ABBA
        handle = lock([ledger.key(a) for a in pair], ttl=30, store=alias)
        assert handle.acquire(timeout=WAIT), f"waited {WAIT} s for accounts {pair}"
        try:
            amount = rng.randint(1, 50)
            source, target = ledger.read(pair[0]), ledger.read(pair[1])
            time.sleep(0.001)  # widen the window two overlapping holders would race in
            for account, balance in ((pair[0], source["balance"] - amount),
                                     (pair[1], target["balance"] + amount)):  # fmt: skip
                refused += not ledger.write(account, balance, handle.fences[ledger.key(account)])
        finally:
            assert handle.release(), "the lock was lost during a transfer"
        done += 1
    out.write_text(json.dumps({"transfers": done, "refused": refused}))


def run_workers(alias: str, target: Callable[..., None], args: list[tuple[object, ...]]) -> None:
    """Processes, one per args (threads on the memory store); each must end cleanly."""
    if alias == "memory":
        errors: list[BaseException] = []

        def guarded(*each: object) -> None:
            try:
                target(*each)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=each) for each in args]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DURATION + WAIT + 30)
        assert not errors, errors
        return
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=target, args=each) for each in args]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(DURATION + WAIT + 30)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)


def check_transfers(alias: str, key: str, folder: Path) -> None:
    ledger = Ledger(folder, key)
    ledger.open()
    until = time.time() + DURATION
    outs = [folder / f"worker-{number}.json" for number in range(WORKERS)]
    run_workers(alias, transfers, [(alias, ledger, n, outs[n], until) for n in range(WORKERS)])

    results = [json.loads(out.read_text()) for out in outs]
    counts = [result["transfers"] for result in results]
    assert sum(result["refused"] for result in results) == 0, "two holders of a key overlapped"
    assert ledger.total() == ACCOUNTS * START_BALANCE
    assert min(counts) >= 0.3 * statistics.mean(counts), f"a worker starved: {counts}"
    everything = lock([ledger.key(a) for a in range(ACCOUNTS)], store=alias)
    assert everything.acquire(), "a key is still held after every transfer ended"
    assert everything.release()


#: Every store's run, etcd's (a cluster the test starts) last; CI's two passes split them.
RUNS = in_shard([*store_params(list(STORE_AVAILABILITY)), pytest.param("etcd", id="etcd")])


@pytest.mark.parametrize("alias", RUNS)
def test_transfers_conserve_money_and_never_overlap_or_starve(
    alias: str, key: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if alias == "etcd":
        alias = request.getfixturevalue("etcd_alias")
    check_transfers(alias, key, tmp_path)
