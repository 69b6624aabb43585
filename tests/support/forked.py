"""Run a function in a forked child of the test process and read back what it returned."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_forked_child(report: Callable[[], str]) -> tuple[str, int]:
    """What `report()` returned in a forked child (which then leaves without cleanup), and
    the child's pid."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, report().encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read().decode(), pid
