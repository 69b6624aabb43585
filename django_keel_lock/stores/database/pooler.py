"""Whether a PostgreSQL connection reaches its server through a pooler (or any proxy).

PgBouncer, RDS Proxy, Supavisor, pgcat and the like open their own connections to the server,
so the server sees the client address of the pooler's socket, not ours, and runs our
statements in a backend other than the one the pooler named to us at startup (its own
BackendKeyData, for cancels): `through_pooler` compares both. The pid finds a pooler that
talks over Unix sockets at both ends (Debian's layout beside the server), where neither side
has an address to compare. A pooler in transaction mode may run each transaction on another server
connection, so nothing may be left on a session (prepared statements, LISTEN, SET); one in
session mode keeps a server connection per client, but looks the same from here, so a
session pooler (or a plain TCP proxy, a container's port forwarding) is taken for a transaction
pooler until the store's OPTIONS say otherwise (TRANSACTION_POOLER: False). A Unix socket to a
server that sees no address, in the backend we were told of, is direct.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, NamedTuple

#: What the server sees of the connection it runs this on: (address or NULL, port or NULL,
#: the backend's pid).
SEEN_SQL = "SELECT host(inet_client_addr()), inet_client_port(), pg_backend_pid()"


class Seen(NamedTuple):
    """Where the connection comes from: as the server sees it, and as our socket says."""

    server: str  # "address:port" or "a Unix socket", and "backend <pid>"
    ours: str

    @property
    def pooled(self) -> bool:
        return self.server != self.ours


def seen(raw: Any) -> Seen:
    """How the server and our side of the driver connection `raw` (psycopg 3 or 2) name its
    client end."""
    cursor = raw.cursor()
    try:
        cursor.execute(SEEN_SQL)
        address, port, pid = cursor.fetchone()
    finally:
        cursor.close()
    server = "a Unix socket" if address is None else _name(address, int(port))
    # psycopg 3 and psycopg2 (2.8+) alike: the pid of the startup's BackendKeyData.
    told = raw.info.backend_pid
    return Seen(f"{server}, backend {pid}", f"{_ours(raw.fileno())}, backend {told}")


def through_pooler(raw: Any) -> bool:
    """Whether the driver connection `raw` reaches its server through a pooler or proxy."""
    return seen(raw).pooled


def _ours(fileno: int) -> str:
    with socket.socket(fileno=os.dup(fileno)) as sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return "a Unix socket"
        address, port = sock.getsockname()[:2]
    return _name(address, int(port))


def _name(address: str, port: int) -> str:
    """`address:port`, an IPv4 address mapped into IPv6 written as IPv4."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{port}"
