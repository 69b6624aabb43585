"""`manage.py locks run` / `locks lead` in processes of their own, and the children they run:
small Python programs that say what happened to them in files the test reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import ROOT
from .holders import MANAGE, child_env

#: A child for `locks run`: writes "<pid> <fence>" to argv[1], then on SIGTERM appends "term"
#: (and exits argv[3] after argv[4] seconds), else sleeps argv[2] seconds and exits argv[3].
#: argv[5] == "deaf": SIGTERM is ignored.
CHILD = r"""
import os, signal, sys, time
path, sleep, code, linger, mode = sys.argv[1:6]
sleep, code, linger = float(sleep), int(code), float(linger)
def note(text):
    with open(path, "a") as f:
        f.write(text + "\n")
def on_term(signum, frame):
    note("term")
    time.sleep(linger)
    note("exit")
    sys.exit(code)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "deaf" else on_term)
note(f"{os.getpid()} {os.environ.get('KEEL_LOCK_FENCE')} {os.environ.get('KEEL_LOCK_KEY')}")
time.sleep(sleep)
note("exit")
sys.exit(code)
"""


def child_command(
    notes: Path, *, sleep: float = 0, code: int = 0, linger: float = 0, deaf: bool = False
) -> list[str]:
    mode = "deaf" if deaf else "-"
    return [sys.executable, "-c", CHILD, str(notes), str(sleep), str(code), str(linger), mode]


def start_locks(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`manage.py locks <args>` started in a fresh process on the test databases (`env`: more
    environment, e.g. REDIS_URL through a proxy the test can cut)."""
    return subprocess.Popen(
        [sys.executable, "-c", MANAGE, "locks", *args],
        cwd=ROOT, env={**child_env(), **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def notes_of(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def wait_for(what: Callable[[], object], timeout: float = 20, message: str = "") -> object:
    """`what()` once it is truthy, polled every 20 ms; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {message or what}")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    except (FileNotFoundError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signum - 1) & 1)
