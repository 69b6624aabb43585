"""A PostgreSQL server of the test's own (Debian's binaries, a data directory in a temporary
directory, a free port), to crash and restart without touching the shared test server.

    with pg_server() as server:
        server.settings          # a DATABASES entry for its "postgres" database
        server.pause_wal_writer() # nothing flushes an asynchronous commit any more
        server.crash()            # every process of the server killed, as by a power cut
        server.start()            # crash recovery replays what the WAL on disk holds
"""

from __future__ import annotations

import glob
import os
import pwd
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any


def pg_bin() -> Path | None:
    """Debian's PostgreSQL binaries (the newest version installed), if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgServer:
    """A running server of our own: how to reach it, crash it and start it again."""

    def __init__(self, bin_dir: Path, root: Path) -> None:
        self.bin_dir, self.root, self.port = bin_dir, root, _free_port()
        self.data, self.log = root / "data", root / "server.log"
        self.user = "postgres"

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "ENGINE": "django.db.backends.postgresql",
            "HOST": "127.0.0.1",
            "PORT": self.port,
            "USER": self.user,
            "NAME": "postgres",
        }

    def _run(self, *args: str) -> None:
        done = subprocess.run([*_as_postgres(), *args], capture_output=True, timeout=120, text=True)
        if done.returncode != 0:
            log = self.log.read_text()[-1500:] if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {done.stderr}{done.stdout}\n{log}")

    def init(self) -> None:
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run(
            str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", self.user,
            "--auth=trust", "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        # No autovacuum and no timed checkpoint: nothing but the test writes or flushes WAL.
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            "-c autovacuum=off -c checkpoint_timeout=1h -c fsync=on"
        )
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
            "-o", options, "-w", "-t", "60", "start",
        )  # fmt: skip

    def _pids(self) -> list[int]:
        """The postmaster and every process it started."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == postmaster:
                children.append(int(Path(stat).parent.name))
        return [postmaster, *children]

    def pause_wal_writer(self) -> None:
        """Stop the WAL writer (SIGSTOP): an asynchronous commit then stays in the server's
        memory until a synchronous one flushes the WAL past it (or a crash loses it)."""
        for pid in self._pids():
            if "walwriter" in _cmdline(pid):
                os.kill(pid, signal.SIGSTOP)
                return
        raise RuntimeError(f"no WAL writer among {self._pids()}")

    def crash(self) -> None:
        """Kill the postmaster and all its processes at once (SIGKILL), as a power cut would
        stop them: what only their memory held is gone."""
        pids = self._pids()
        for pid in pids:
            with suppress(ProcessLookupError):  # a backend that was ending (a client closed)
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            while _state(pid) not in ("", "Z"):  # gone, or a zombie nobody reaps here
                os.sched_yield()
        # As after a reboot: the lock file names a postmaster that is no more (here its
        # zombie's pid may linger, and the server would take it for a running one).
        (self.data / "postmaster.pid").unlink()
        for lock in self.root.glob(".s.PGSQL.*.lock"):  # the socket's, likewise
            lock.unlink()

    def stop(self) -> None:
        subprocess.run(
            [*_as_postgres(), str(self.bin_dir / "pg_ctl"), "-D", str(self.data),
             "-m", "immediate", "-w", "stop"],
            capture_output=True, timeout=60,
        )  # fmt: skip


def _as_postgres() -> list[str]:
    """PostgreSQL refuses to run as root: as root (a container, CI), as the postgres user."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@contextmanager
def pg_server() -> Iterator[PgServer]:
    """A new server of our own while the block runs; then it is stopped and its data gone."""
    bin_dir = pg_bin()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL server binaries (apt-get install postgresql)")
    with tempfile.TemporaryDirectory(prefix="keel-pg-") as directory:
        server = PgServer(bin_dir, Path(directory))
        server.init()
        server.start()
        try:
            yield server
        finally:
            try:
                for pid in server._pids():
                    os.kill(pid, signal.SIGCONT)  # a paused WAL writer must see the stop
            except (OSError, ValueError):
                pass
            server.stop()
