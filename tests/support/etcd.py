"""A real 3-member etcd cluster on free loopback ports for the etcd tests (and the bench).

etcd (Debian's etcd-server, 3.4) must be on PATH or at /usr/bin/etcd; under CI=true a missing
etcd fails the tests that need it (tests.conftest.skip_or_fail). Members run with a 50 ms
heartbeat and a 500 ms election timeout, so a lost leader is replaced within about a second
and the shortest lease is 1 s.

    python -m tests.support.etcd count --endpoints E,E,E --key K --iterations N --counter FILE
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .redis_servers import free_port, wait_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_installed() -> bool:
    return os.path.exists(ETCD)


def make_certificates(folder: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it (PEM
    files in `folder`, made with openssl): the paths by name. With the extensions Python
    3.13's strict verification (VERIFY_X509_STRICT) asks for; the server's may serve as a
    client's too, as etcd's gateway dials its own gRPC server with it."""
    paths = {name: os.path.join(folder, f"{name}.pem") for name in ("ca", "ca-key")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=keel-test-ca", "-keyout", paths["ca-key"], "-out", paths["ca"],
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    leaf += "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    for who, extra in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, request = os.path.join(folder, f"{who}-key.pem"), os.path.join(folder, f"{who}.csr")
        cert, ext = os.path.join(folder, f"{who}.pem"), os.path.join(folder, f"{who}.ext")
        with open(ext, "w") as handle:
            handle.write(leaf + extra + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
                 "-keyout", key, "-out", request)  # fmt: skip
        _openssl("x509", "-req", "-in", request, "-CA", paths["ca"], "-CAkey", paths["ca-key"],
                 "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", cert)  # fmt: skip
        paths[who], paths[f"{who}-key"] = cert, key
    return paths


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


class Member:
    """One etcd member process; stoppable, killable and restartable with its data. With
    `tls` (make_certificates' paths) its client URL is https and asks for a client
    certificate."""

    def __init__(self, name: str, folder: str, tls: dict[str, str] | None = None) -> None:
        self.name = name
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.dir = os.path.join(folder, name)
        self.process: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(folder, f"{name}.log")

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, cluster: str, state: str = "new") -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    ETCD,
                    "--name",
                    self.name,
                    "--data-dir",
                    self.dir,
                    "--listen-client-urls",
                    self.url,
                    "--advertise-client-urls",
                    self.url,
                    "--listen-peer-urls",
                    self.peer_url,
                    "--initial-advertise-peer-urls",
                    self.peer_url,
                    "--initial-cluster",
                    cluster,
                    "--initial-cluster-state",
                    state,
                    "--initial-cluster-token",
                    f"keel-{os.getpid()}",
                    "--heartbeat-interval",
                    "50",
                    "--election-timeout",
                    "500",
                    "--log-level",
                    "warn",
                    *self._tls_flags(),
                ],
                stdout=log,
                stderr=log,
            )

    def _tls_flags(self) -> list[str]:
        if not self.tls:
            return []
        return [
            *("--cert-file", self.tls["server"], "--key-file", self.tls["server-key"]),
            *("--trusted-ca-file", self.tls["ca"], "--client-cert-auth"),
        ]

    def kill(self) -> None:
        """SIGKILL: the member vanishes, like a crash (its data stays for a restart)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/v3/maintenance/status", data=b"{}", method="POST"
        )
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls["ca"])
            context.load_cert_chain(self.tls["client"], self.tls["client-key"])
        with urllib.request.urlopen(request, timeout=2, context=context) as reply:
            return dict(json.load(reply))


class Cluster:
    """Three members; `endpoints` for OPTIONS ENDPOINTS."""

    def __init__(self, size: int = 3, tls: bool = False) -> None:
        self.folder = tempfile.mkdtemp(prefix=f"keel-etcd-{os.getpid()}-")
        self.tls = make_certificates(self.folder) if tls else None
        self.members = [Member(f"m{i}", self.folder, self.tls) for i in range(size)]

    @property
    def endpoints(self) -> list[str]:
        return [member.url for member in self.members]

    @property
    def initial(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def start(self) -> Cluster:
        for member in self.members:
            member.start(self.initial)
        for member in self.members:
            wait_port(member.client_port, 30)
        self.wait_healthy()
        return self

    def restart(self, member: Member) -> None:
        member.kill()
        member.start(self.initial, "existing")
        wait_port(member.client_port, 30)

    def leader(self) -> Member:
        """The member that leads now (waiting up to 20 s for one)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for member in self.members:
                if member.process is None:
                    continue
                try:
                    status = member.status()
                except OSError:
                    continue
                if status.get("leader") == status["header"]["member_id"]:
                    return member
            time.sleep(0.05)
        raise RuntimeError("the etcd cluster has no leader after 20 s")

    def wait_healthy(self) -> None:
        """Until a leader exists and every running member answers."""
        self.leader()
        for member in self.members:
            if member.process is not None:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        member.status()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

    def stop(self) -> None:
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                try:
                    member.resume()
                except OSError:
                    pass
            member.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class LosesOneReply:
    """A TCP proxy in front of a member that, once armed with a path ("/v3/kv/txn"), passes
    the next request for it on and cuts the client's connection instead of passing its reply:
    the request was applied, its answer lost. Everything else passes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.armed: str | None = None
        self.cut = 0  # replies lost so far
        self._doomed: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.armed and data.startswith(f"POST {self.armed} ".encode()):
                    self.armed = None
                    self._doomed.add(client)  # before the request goes: its reply never comes
                upstream.sendall(data)
        upstream.close()

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if client in self._doomed:
                    self.cut += 1
                    break
                client.sendall(data)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()


class HoldsARequest(LosesOneReply):
    """A LosesOneReply that can also hold a request: armed with `hold` (a path and how many
    of its requests to pass first), it holds the next one back (`holding` set) until the test
    sets `go`; everything else passes."""

    def __init__(self, target_port: int) -> None:
        self.hold: tuple[str, int] | None = None
        self.holding, self.go = threading.Event(), threading.Event()
        super().__init__(target_port)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.hold and data.startswith(f"POST {self.hold[0]} ".encode()):
                    path, passes = self.hold
                    self.hold = (path, passes - 1) if passes else None
                    if not passes:
                        self.holding.set()
                        self.go.wait(30)
                upstream.sendall(data)
        upstream.close()


@contextmanager
def etcd_cluster(size: int = 3, tls: bool = False) -> Iterator[Cluster]:
    cluster = Cluster(size, tls)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _count(args: argparse.Namespace) -> None:
    """A child's loop for the mutual exclusion test: under the lock, read the counter file,
    pause, write it back plus one; a lost update means two holders at once."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_keel_lock import lock, set_lock_store
    from django_keel_lock.stores import EtcdLockStore

    store = EtcdLockStore("etcd-child", {"ENDPOINTS": args.endpoints.split(",")})
    set_lock_store(store, "etcd-child")
    fences = []
    for _ in range(args.iterations):
        with lock(args.key, store="etcd-child", ttl=10, timeout=60) as held:
            with open(args.counter) as handle:
                value = int(handle.read() or 0)
            time.sleep(0.002)
            with open(args.counter, "w") as handle:
                handle.write(str(value + 1))
            fences.append(held.fence)
    print(json.dumps({"fences": fences}), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.etcd")
    commands = parser.add_subparsers(dest="command", required=True)
    count = commands.add_parser("count")
    count.add_argument("--endpoints", required=True)
    count.add_argument("--key", required=True)
    count.add_argument("--iterations", type=int, default=20)
    count.add_argument("--counter", required=True)
    args = parser.parse_args(argv)
    _count(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
