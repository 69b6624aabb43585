"""Real Redis servers, a fault-injecting TCP proxy and child-process workers for the Redis tests.

Servers are started by the tests themselves on free ports (redis-server must be on PATH or at
/usr/bin/redis-server) and killed when the test is done.

Workers run lock operations in another Python process and print one JSON line per event:

    python -m tests.support.redis_servers count --url U --key K --iterations N --counter FILE
    python -m tests.support.redis_servers wait --url U --key K --timeout T --retry-delay D
    python -m tests.support.redis_servers stale --alias A --key K --ttl T --work W
    python -m tests.support.redis_servers requests --alias A --key K --iterations N
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from . import ROOT

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 40000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


_SHIFTED_CLOCK: list[str] = []  # the library, once built


def shifted_clock_library() -> str | None:
    """The LD_PRELOAD library that shifts a process's wall clock by KEEL_CLOCK_SHIFT seconds
    (tests/support/shifted_clock.c, built once per run with the system's C compiler); None
    without a compiler. `faketime` cannot start redis-server: its jemalloc and libfaketime
    call each other while libfaketime initialises."""
    if _SHIFTED_CLOCK:
        return _SHIFTED_CLOCK[0]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder = tempfile.mkdtemp(prefix="keel-clock-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    built = os.path.join(folder, "shifted_clock.so")
    source = ROOT / "tests" / "support" / "shifted_clock.c"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", built, str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    _SHIFTED_CLOCK.append(built)
    return built


class RedisServer:
    """One redis-server process on a free port, without persistence; restartable on the same
    port so clients configured with its URL find it again. `clock_shift` (seconds; negative:
    behind) moves its wall clock (TIME, key expiry) through `shifted_clock_library`."""

    def __init__(self, *extra: str, port: int | None = None, clock_shift: int = 0) -> None:
        self.port = port or free_port()
        self.extra = list(extra)
        self.clock_shift = clock_shift
        self.dir = tempfile.mkdtemp(prefix=f"keel-redis-{self.port}-")
        self.process: subprocess.Popen[bytes] | None = None

    def _environment(self) -> dict[str, str] | None:
        if not self.clock_shift:
            return None
        library = shifted_clock_library()
        if library is None:
            raise RuntimeError("a C compiler (cc) is needed to shift a Redis server's clock")
        return {**os.environ, "LD_PRELOAD": library, "KEEL_CLOCK_SHIFT": str(self.clock_shift)}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._environment(),
        )
        wait_port(self.port)
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, like a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def cli(self, *args: str) -> str:
        return subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    server = RedisServer(*extra).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def redis_cluster(size: int = 3) -> Iterator[list[RedisServer]]:
    """`size` masters joined with `redis-cli --cluster create`, slots all covered."""
    nodes = [RedisServer(port=free_cluster_port()) for _ in range(size)]
    try:
        for node in nodes:
            node.extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                os.path.join(node.dir, "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
            node.start()
        created = subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}"
            )
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in node.cli("cluster", "info") for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


class SentinelSetup(NamedTuple):
    master: RedisServer
    sentinel: RedisServer
    replicas: list[RedisServer]


@contextmanager
def redis_sentinel(
    service: str = "keelmaster",
    monitor_port: int | None = None,
    down_after_ms: int = 2000,
    replicas: int = 0,
) -> Iterator[SentinelSetup]:
    """A master, `replicas` replicas of it and one sentinel monitoring it (quorum 1). The
    sentinel tells clients the master is at `monitor_port` (a proxy in front of it) if given."""
    master = RedisServer().start()
    copies = [RedisServer("--replicaof", "127.0.0.1", str(master.port)) for _ in range(replicas)]
    sentinel = RedisServer()
    announced = monitor_port or master.port
    conf = os.path.join(sentinel.dir, "sentinel.conf")
    with open(conf, "w") as handle:
        handle.write(
            f"port {sentinel.port}\n"
            f"bind 127.0.0.1\n"
            f"dir {sentinel.dir}\n"
            f"sentinel monitor {service} 127.0.0.1 {announced} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
        )
    try:
        for copy in copies:  # in sync before the sentinel starts, so it finds them at once
            copy.start()
            wait_for(lambda c=copy: "master_link_status:up" in c.cli("info", "replication"))
        sentinel.process = subprocess.Popen(
            [REDIS_SERVER, conf, "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(sentinel.port)
        wait_for(lambda: master_of(sentinel, service) == announced, what="the master")
        wait_for(lambda: len(replicas_of(sentinel, service)) >= replicas, what="the replicas")
        yield SentinelSetup(master, sentinel, copies)
    finally:
        sentinel.stop()
        for copy in copies:
            copy.stop()
        master.stop()


@contextmanager
def via_sentinel(
    sentinel_port: int,
    service: str = "keelmaster",
    store_options: dict[str, Any] | None = None,
    **pool_kwargs: Any,
) -> Iterator[str]:
    """django-redis' SentinelClient as the project would configure it, and a store reusing it
    (with `store_options` besides its CONNECTION); the store's alias."""
    from django.test import override_settings

    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "sentinel": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://{service}/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [("127.0.0.1", sentinel_port)],
                "CONNECTION_POOL_KWARGS": pool_kwargs,
            },
        },
    }
    stores = {
        "via-sentinel": {
            "BACKEND": "django_keel_lock.stores.RedisLockStore",
            "OPTIONS": {"CONNECTION": "sentinel", **(store_options or {})},
        }
    }
    with override_settings(CACHES=caches, KEEL_LOCK_STORES=stores):
        yield "via-sentinel"


def master_of(sentinel: RedisServer, service: str) -> int | None:
    """The port `sentinel` currently names as `service`'s master."""
    reply = sentinel.cli("sentinel", "get-master-addr-by-name", service).split()
    return int(reply[1]) if len(reply) == 2 else None


def replicas_of(sentinel: RedisServer, service: str) -> list[str]:
    """The names ("host:port") of the replicas `sentinel` knows for `service`."""
    lines = sentinel.cli("sentinel", "replicas", service).split()
    return [value for field, value in itertools.pairwise(lines) if field == "name"]


def own_connections(client: Any, name: str) -> int:
    """How many connections named `name` (CLIENT SETNAME) `client`'s server has open: one
    process's own, whatever else is connected to the same server."""
    return sum(1 for entry in client.client_list() if entry.get("name") == name)


def settled_connections(client: Any, name: str, at_most: int | None = None) -> int:
    """`own_connections` once it is at most `at_most` (None: once two reads 50 ms apart
    agree), or after 5 s: the server takes a moment to see a close."""
    deadline = time.monotonic() + 5
    count = own_connections(client, name)
    while time.monotonic() < deadline:
        if at_most is not None and count <= at_most:
            break
        time.sleep(0.05)
        previous, count = count, own_connections(client, name)
        if at_most is None and count == previous:
            break
    return count


@contextmanager
def collector_off() -> Iterator[None]:
    """Without the garbage collector: what is left open, not what it would close later."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def wait_for(condition: Callable[[], object], seconds: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what or condition}")
        time.sleep(0.05)


class FaultyProxy:
    """A TCP proxy in front of a server whose behaviour the test switches at will:
    "pass" forwards both ways; "drop_replies" forwards requests but closes the client's
    connection instead of passing a reply (the command ran, its answer is lost);
    "drop_one_reply" does that once, then passes again; "stall" holds every byte in both
    directions without closing anything. `stall_on`: bytes that, once a request holding
    them has passed, turn the mode to "stall" (that request's reply is held). `silent`: while
    it stalls, one end closing is not passed on to the other (a partition)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self.stall_on: bytes | None = None
        self.silent = False
        self.trips = 0  # round trips: requests sent after a reply (or first), on any connection
        self._replied = True
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._mutex = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._mutex:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, reply: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                with self._mutex:
                    self.trips += self._replied and not reply
                    self._replied = reply
                while self.mode == "stall" and not self._closing.is_set():
                    time.sleep(0.01)
                if reply and self.mode in ("drop_replies", "drop_one_reply"):
                    if self.mode == "drop_one_reply":
                        self.mode = "pass"
                    break
                sink.sendall(data)
                if not reply and self.stall_on is not None and self.stall_on in data:
                    self.stall_on, self.mode = None, "stall"
        except OSError:
            pass
        while self.silent and self.mode == "stall" and not self._closing.is_set():
            time.sleep(0.01)  # a silent stall tells neither end that the other closed
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        """Stop accepting and cut every connection, both ways. shutdown() first: a socket
        closed while another thread blocks in accept() or recv() on it stays open until that
        call returns, and the server would keep the session (PostgreSQL then refuses to drop
        the test database)."""
        self._closing.set()
        with self._mutex:
            sockets = [self._listener, *self._sockets]
        _cut(sockets)

    def drop_connections(self) -> None:
        """Cut every connection through the proxy and forget what it held back: a frozen link
        that comes back without the requests that were in flight. New connections still pass."""
        with self._mutex:
            sockets, self._sockets = self._sockets, []
        _cut(sockets)


def _cut(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def check_lost_release_reply(proxy: FaultyProxy, store: Any, key: str) -> None:
    """Take `key` through `store` (registered under its alias), then lose the release's reply
    once: the caller hears LockStoreUnavailable, the handle still holds the lock (it is not
    reported lost: Redis never answered), and Redis released it exactly once."""
    from django_keel_lock import LockStoreUnavailable, lock

    held = lock(key, ttl=30, store=store.alias)
    assert held.acquire()
    proxy.mode = "drop_one_reply"
    try:
        held.release()
    except LockStoreUnavailable:
        pass
    else:
        raise AssertionError("a release whose reply was lost did not raise LockStoreUnavailable")
    assert held.held and not held.lost
    assert store.get(key) is None


# -- child-process workers ----------------------------------------------------------------


def spawn(*args: str, flags: Sequence[str] = ()) -> subprocess.Popen[str]:
    """Start `python <flags> -m tests.support.redis_servers <args>` with the test settings."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, *flags, "-m", "tests.support.redis_servers", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_event(process: subprocess.Popen[str], timeout: float = 30.0) -> dict[str, Any]:
    """The child's next JSON line, failing loudly (with its stderr) if it dies or hangs."""
    assert process.stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()))  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    line = result[0] if result else ""
    if not line:
        process.kill()
        _, err = process.communicate(timeout=10)
        raise AssertionError(f"child gave no event within {timeout}s; stderr:\n{err}")
    return dict(json.loads(line))


def _emit(**data: Any) -> None:
    print(json.dumps(data), flush=True)


def _store_alias(url: str) -> str:
    """Register a RedisLockStore for `url` under an alias of its own in this process."""
    import django

    django.setup()
    from django_keel_lock import set_lock_store
    from django_keel_lock.stores import RedisLockStore

    set_lock_store(RedisLockStore("child", {"URL": url}), "child")
    return "child"


def _count(args: argparse.Namespace) -> None:
    from django_keel_lock import lock

    alias = _store_alias(args.url)
    handle = lock(args.key, ttl=30, timeout=60, retry_delay=0.05, store=alias)
    intervals = []
    _emit(event="ready")
    for _ in range(args.iterations):
        with handle:
            start = time.monotonic()
            path = Path(args.counter)
            value = int(path.read_text() or "0")
            time.sleep(0.001)  # widen the read-modify-write window
            path.write_text(str(value + 1))
            intervals.append((start, time.monotonic(), handle.fence))
    _emit(event="done", pid=os.getpid(), intervals=intervals)


def _wait(args: argparse.Namespace) -> None:
    from django_keel_lock import lock

    alias = _store_alias(args.url)
    handle = lock(args.key, ttl=30, store=alias)
    handle.store.watch(args.key).__enter__()  # start the listener before the test releases
    deadline = time.monotonic() + 10
    while not handle.store.push_wakeups and time.monotonic() < deadline:
        time.sleep(0.01)
    _emit(event="waiting", push=handle.store.push_wakeups)
    acquired = handle.acquire(timeout=args.timeout, retry_delay=args.retry_delay)
    _emit(event="returned", acquired=acquired, at=time.monotonic(), fence=handle.fence)
    if acquired:
        handle.release()


def _stale(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django_keel_lock import LockNotHeldError, lock, restore_lock

    # The settings' alias, like the test's: restore_lock finds the store by alias.
    handle = lock(args.key, ttl=args.ttl, store=args.alias)
    assert handle.acquire()
    token = handle.serialize()
    _emit(event="acquired", fence=handle.fence, owner=handle.owner)
    end = time.monotonic() + args.work
    while time.monotonic() < end:  # "work"; the test pauses us with SIGSTOP meanwhile
        time.sleep(0.01)
    try:
        handle.extend()
        extended = "extended"
    except LockNotHeldError as exc:
        extended = f"raised: {exc}"
    released = restore_lock(token).release()
    _emit(event="after", extend=extended, release=released, fence=handle.fence)


def _requests(args: argparse.Namespace) -> None:
    """`args.iterations` requests to an async lock_view on `args.alias` through Django's test
    Client, which runs each in an event loop of its own (async_to_sync), as a WSGI server does;
    then how many of this process's connections are open."""
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.test import Client

    raw = redis.Redis.from_url(settings.REDIS_URL)  # unnamed: not counted
    browser = Client()

    def request(index: int) -> None:
        response = browser.get(f"/views/astore/{args.alias}/{args.key}-{index}/")
        assert response.status_code == 200, response.content

    request(-1)  # the first may connect the store's sync client, kept for the process
    name = settings.REDIS_CLIENT_NAME
    before = settled_connections(raw, name)
    with collector_off():
        for index in range(args.iterations):
            request(index)
        after = settled_connections(raw, name, at_most=before)
    gc.collect()  # anything unclosed warns now, on stderr
    raw.close()
    _emit(event="done", before=before, after=after)


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["count", "wait", "stale", "requests"])
    parser.add_argument("--url", default="")
    parser.add_argument("--alias", default="redis-url")
    parser.add_argument("--key", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--counter", default="")
    parser.add_argument("--timeout", type=float, default=10)
    parser.add_argument("--retry-delay", type=float, default=0.05)
    parser.add_argument("--ttl", type=float, default=30)
    parser.add_argument("--work", type=float, default=1)
    args = parser.parse_args(argv)
    {"count": _count, "wait": _wait, "stale": _stale, "requests": _requests}[args.command](args)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
