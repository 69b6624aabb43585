"""The nemesis and the workers it preys on: at random intervals (a seeded RNG) it kills a
worker (and starts another), pauses one past its ttl, or injects one of the store's faults;
each fault is logged with its monotonic times."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .stores import Fault
from .workers import History, work

ROOT = Path(__file__).resolve().parents[2]


class FaultLog:
    """The nemesis' record, a JSON object a line like the workers'."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the run
        self._mutex = threading.Lock()

    def log(self, kind: str, **info: Any) -> None:
        with self._mutex:
            self._file.write(json.dumps({"ev": "fault", "kind": kind, **info}) + "\n")
            self._file.flush()


def pick(rng: random.Random, workers: list[str], folder: Path) -> str:
    """A victim: half the time one that holds a lock now (its history's last line is inside
    a section), so kills test takeovers (rule 4) and not only waiters; else any."""
    holders = [w for w in workers if _holding(folder / f"{w}.jsonl")]
    return rng.choice(holders if holders and rng.random() < 0.5 else workers)


def _holding(path: Path) -> bool:
    """Whether the worker of history `path` is inside a section: an enter after its exit."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = handle.read().splitlines()[1:]  # the first may be cut
    except OSError:
        return False
    for line in reversed(lines):
        ev = str(json.loads(line)["ev"])
        if ev in ("enter", "exit", "done", "start"):
            return ev == "enter"
    return False


class Processes:
    """Workers as processes of their own: SIGKILL and SIGSTOP/SIGCONT are the real thing."""

    def __init__(self, folder: Path, config: dict[str, Any], seed: int, log: FaultLog) -> None:
        self.folder, self.config, self.seed, self.log = folder, config, seed, log
        self.running: dict[str, tuple[subprocess.Popen[bytes], Any]] = {}
        self.count = 0
        self.env = dict(
            os.environ,
            KEEL_CHAOS_CONFIG=json.dumps(config),
            DJANGO_SETTINGS_MODULE="bench.chaos.settings",
            PYTHONPATH=str(ROOT),
        )

    def spawn(self) -> None:
        self.count += 1
        worker = f"w{self.count}"
        stderr = open(self.folder / f"{worker}.err", "wb")  # noqa: SIM115 - closed in reap
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.chaos.workers",
                worker,
                str(self.folder / f"{worker}.jsonl"),
                f"{self.seed}:{self.count}",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        self.running[worker] = (process, stderr)

    def reap(self) -> None:
        """Log workers that exited on their own before the end (a crash) and replace them."""
        for worker, (process, _) in list(self.running.items()):
            if process.poll() is not None:
                self._crashed(worker, process.returncode)
                self.spawn()

    def _crashed(self, worker: str, rc: int) -> None:
        self.running.pop(worker)[1].close()
        tail = (self.folder / f"{worker}.err").read_text(errors="replace")[-2000:]
        self.log.log("crash", victim=worker, rc=rc, dead_at=time.monotonic(), stderr=tail)

    def kill(self, rng: random.Random) -> dict[str, Any]:
        worker = pick(rng, sorted(self.running), self.folder)
        process, stderr = self.running.pop(worker)
        process.kill()
        dead_at = time.monotonic()
        process.wait()
        stderr.close()
        self.spawn()
        return {"victim": worker, "dead_at": dead_at}

    def pause(self, rng: random.Random) -> dict[str, Any]:
        worker = rng.choice(sorted(self.running))
        process = self.running[worker][0]
        seconds = rng.uniform(self.config["ttl"] + 0.5, self.config["ttl"] + 2.5)
        process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(seconds)
        process.send_signal(signal.SIGCONT)
        return {"victim": worker, "stopped": stopped, "resumed": time.monotonic()}

    def finish(self, grace: float) -> None:
        """Wait for the workers to stop at the run's end; kill what is left after `grace`."""
        deadline = time.monotonic() + grace
        for worker, (process, _) in list(self.running.items()):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                self.log.log("end_kill", victim=worker, dead_at=time.monotonic())
                process.wait()
                self.running.pop(worker)[1].close()
                continue
            if process.returncode:
                self._crashed(worker, process.returncode)
            else:
                self.running.pop(worker)[1].close()


class Killed(BaseException):
    """A thread worker's death: raised out of its nap, past every `except Exception`."""


class _Thread:
    def __init__(self) -> None:
        self.kill = threading.Event()
        self.pause_for = 0.0
        self.thread: threading.Thread | None = None

    def nap(self, seconds: float) -> None:
        """Sleep `seconds`, longer by a pause the nemesis asked for meanwhile; die if told."""
        end = time.monotonic() + seconds
        while True:
            if self.kill.is_set():
                raise Killed
            if self.pause_for:
                pause, self.pause_for = self.pause_for, 0.0
                time.sleep(pause)
                end += pause
            left = end - time.monotonic()
            if left <= 0:
                return
            self.kill.wait(min(left, 0.02))


class Threads:
    """Workers as threads of this process (the memory store lives in one process). A kill
    makes the thread stop at its next sleep without releasing, dropping its handle; a pause
    makes its next sleep longer (its watchdog, another thread, keeps running)."""

    def __init__(self, folder: Path, config: dict[str, Any], seed: int, log: FaultLog) -> None:
        self.folder, self.config, self.seed, self.log = folder, config, seed, log
        self.running: dict[str, _Thread] = {}
        self.count = 0

    def spawn(self) -> None:
        self.count += 1
        worker = f"w{self.count}"
        state = _Thread()
        history = History(str(self.folder / f"{worker}.jsonl"), worker)
        rng = random.Random(f"{self.seed}:{self.count}")

        def run() -> None:
            history.log(ev="start", pid=os.getpid(), t=time.monotonic())
            try:
                work(
                    history,
                    self.config,
                    rng,
                    state.nap,
                    lambda: time.monotonic() > self.config["until"],
                )
            except Killed:
                return
            except BaseException as error:
                self.log.log("crash", victim=worker, rc=repr(error), dead_at=time.monotonic())
                raise
            history.log(ev="stop", t=time.monotonic())

        state.thread = threading.Thread(target=run, name=f"chaos-{worker}", daemon=True)
        self.running[worker] = state
        state.thread.start()

    def reap(self) -> None:
        pass  # a thread that crashed logged it itself

    def kill(self, rng: random.Random) -> dict[str, Any]:
        worker = pick(rng, sorted(self.running), self.folder)
        state = self.running.pop(worker)
        state.kill.set()
        assert state.thread is not None
        state.thread.join(60)
        self.spawn()
        return {"victim": worker, "dead_at": time.monotonic()}

    def pause(self, rng: random.Random) -> dict[str, Any]:
        worker = rng.choice(sorted(self.running))
        seconds = rng.uniform(self.config["ttl"] + 0.5, self.config["ttl"] + 2.5)
        stopped = time.monotonic()
        self.running[worker].pause_for = seconds
        time.sleep(seconds)
        return {"victim": worker, "stopped": stopped, "resumed": stopped + seconds}

    def finish(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for worker, state in list(self.running.items()):
            assert state.thread is not None
            state.thread.join(max(0.1, deadline - time.monotonic()))
            if state.thread.is_alive():
                state.kill.set()
                self.log.log("end_kill", victim=worker, dead_at=time.monotonic())


def run_nemesis(
    workers: Processes | Threads,
    faults: dict[str, Fault],
    rng: random.Random,
    until: float,
    interval: float,
    log: FaultLog,
) -> None:
    """Inject a random fault every `interval` seconds on average until `until`."""
    kinds: dict[str, Callable[[random.Random], dict[str, Any]]] = {
        "kill": workers.kill,
        "pause": workers.pause,
        **faults,
    }
    names = sorted(kinds)
    while True:
        time.sleep(min(rng.expovariate(1 / interval), max(0.0, until - time.monotonic())))
        if time.monotonic() >= until:
            return
        workers.reap()
        kind = rng.choice(names)
        t0 = time.monotonic()
        try:
            info = kinds[kind](rng)
        except Exception as error:  # the fault did not work out: say so, go on with the run
            log.log(f"{kind}_failed", t0=t0, t1=time.monotonic(), error=repr(error))
            continue
        log.log(kind, t0=t0, t1=time.monotonic(), **info)
