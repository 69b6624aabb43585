"""A worker process the tests start (Celery, django-tasks-db) and read the output of."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


class Worker:
    """A worker started in a session of its own (`start_new_session=True`) writing to `log`."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM the worker and its children, SIGKILL them if they linger."""
        stop(self.proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)  # the worker and its pool processes
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
