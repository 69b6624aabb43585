"""A real PgBouncer of the test's own in front of the test PostgreSQL server.

Debian's pgbouncer (1.18: no prepared statements carried across server connections) on a
free port, `pool_mode` as asked (transaction by default), a pool of `pool_size` server
connections per database and user, so that clients really share them. Any database name the
client asks for is passed on to the server (`* =`), with trust authentication.

    with pgbouncer(connections["postgres"].settings_dict) as bouncer:
        bouncer.port, bouncer.admin("SHOW POOLS")
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """A running PgBouncer: where it listens, and its admin console."""

    def __init__(
        self,
        port: int,
        user: str,
        process: subprocess.Popen[bytes],
        log: Path,
        host: str = "127.0.0.1",
    ) -> None:
        self.host, self.port, self.user = host, port, user
        self.process, self.log = process, log

    def settings(self, based_on: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        """A DATABASES entry like `based_on` but through this PgBouncer (`options` added to
        its OPTIONS)."""
        return {
            **based_on,
            "HOST": self.host,
            "PORT": self.port,
            "OPTIONS": {**(based_on.get("OPTIONS") or {}), **options},
        }

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Rows of an admin console command (SHOW POOLS, SHOW SERVERS ...), as dicts."""
        import psycopg

        with psycopg.connect(
            host=self.host, port=self.port, user=self.user, dbname="pgbouncer", autocommit=True
        ) as conn:
            # The console speaks the simple protocol only: no server-side binding.
            cursor = conn.cursor()
            cursor.execute(command.encode(), prepare=False)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


@contextmanager
def pgbouncer(
    server: Mapping[str, Any],
    *,
    pool_mode: str = "transaction",
    pool_size: int = 2,
    unix_sockets: str = "",
) -> Iterator[PgBouncer]:
    """A PgBouncer in front of the PostgreSQL server of the DATABASES entry `server`, while
    the block runs; then it is stopped. `unix_sockets`: the server's Unix socket directory,
    which it then reaches the server through, listening on a Unix socket of its own (its
    `host` is that socket's directory): Debian's layout of a PgBouncer beside its server."""
    user = str(server.get("USER") or "postgres")
    with tempfile.TemporaryDirectory(prefix="keel-pgbouncer-") as directory:
        root = Path(directory)
        port = free_port()
        (root / "users.txt").write_text(f'"{user}" ""\n')
        log = root / "pgbouncer.log"
        host = unix_sockets or str(server.get("HOST") or "127.0.0.1")
        listen = (
            f"listen_addr =\nunix_socket_dir = {root}"
            if unix_sockets
            else ("listen_addr = 127.0.0.1\nunix_socket_dir =")
        )
        (root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host} port={server.get('PORT') or 5432}\n"
            "[pgbouncer]\n"
            f"{listen}\nlisten_port = {port}\n"
            f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
            f"admin_users = {user}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
            "min_pool_size = 0\nreserve_pool_size = 0\nmax_client_conn = 500\n"
            # psycopg and libpq send these at startup; PgBouncer 1.18 refuses what it
            # does not know unless told to ignore it.
            "ignore_startup_parameters = extra_float_digits,options\n"
            "server_reset_query = DISCARD ALL\n"
            f"logfile = {log}\npidfile = {root / 'pgbouncer.pid'}\n"
        )
        process = subprocess.Popen(
            [PGBOUNCER, *_as_user(root), str(root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_listening(port, process, log, root if unix_sockets else None)
            yield PgBouncer(port, user, process, log, str(root) if unix_sockets else "127.0.0.1")
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _as_user(root: Path) -> list[str]:
    """PgBouncer refuses to run as root: as root (a container, CI), run it as `nobody`, who
    must then own its directory (config, log, pid file)."""
    if os.geteuid() != 0:
        return []
    user = pwd.getpwnam("nobody")
    os.chown(root, user.pw_uid, user.pw_gid)
    for path in root.iterdir():
        os.chown(path, user.pw_uid, user.pw_gid)
    return ["-u", user.pw_name]


def _wait_listening(
    port: int, process: subprocess.Popen[bytes], log: Path, unix: Path | None = None
) -> None:
    give_up = time.monotonic() + 15
    while time.monotonic() < give_up:
        if process.poll() is not None:
            text = log.read_text() if log.exists() else ""
            raise RuntimeError(f"pgbouncer exited with {process.returncode}: {text[-2000:]}")
        family, address = (
            (socket.AF_UNIX, str(unix / f".s.PGSQL.{port}"))
            if unix
            else (socket.AF_INET, ("127.0.0.1", port))
        )
        with socket.socket(family) as sock:
            if sock.connect_ex(address) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on port {port} within 15 s")
