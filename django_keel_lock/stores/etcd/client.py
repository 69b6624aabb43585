"""A thin client for etcd v3's JSON gateway (/v3/kv/txn, /v3/lease/grant...), on http.client.

Why our own: the gateway is plain HTTP + JSON on every etcd since 3.4, so no gRPC or protobuf
is needed (the `etcd3` package no longer imports with current protobuf), and a client of ~200
lines lets every call keep one deadline across endpoints, which is what the store needs
most: a call either answers within SOCKET_TIMEOUT or raises `EtcdUnavailable`.

- Each thread keeps one keep-alive connection per endpoint (`PerThread`).
- A call goes to the endpoint that answered last; when it fails, the next one is tried, with
  what is left of the deadline. A call that may not run twice (`once=True`: a release) moves
  on only when nothing was sent, or a member without a leader refused it (nothing applied);
  once sent, any other failure is the caller's to report.
- Every request asks the member to refuse when it has no leader (`hasleader`): a member cut
  off from the others answers at once instead of waiting for a quorum that is not there.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from ..connections import Deadline, PerThread, SocketCheck

#: Sent with every request: a member without a leader refuses at once ("no leader").
HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
#: How a member without a leader refuses a request sent with `hasleader`.
NO_LEADER = "etcdserver: no leader"


class EtcdUnavailable(Exception):
    """etcd did not answer within the deadline, or refused: what was tried, and why."""


class Endpoint(NamedTuple):
    """One member's client URL, as OPTIONS ENDPOINTS names it."""

    scheme: str  # "http" or "https"
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_endpoints(alias: str, value: object) -> tuple[Endpoint, ...]:
    """OPTIONS ENDPOINTS as Endpoints; ImproperlyConfigured saying what is wrong otherwise."""
    where = f"KEEL_LOCK_STORES[{alias!r}] OPTIONS ENDPOINTS"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ImproperlyConfigured(
            f"{where} must be a list of URLs such as ['http://127.0.0.1:2379'], got {value!r}"
        )
    if not value:
        raise ImproperlyConfigured(f"{where} is empty: name at least one etcd member's URL")
    endpoints = tuple(_endpoint(where, each) for each in value)
    if len(set(endpoints)) != len(endpoints):
        raise ImproperlyConfigured(f"{where} names a member twice: {list(value)!r}")
    return endpoints


def _endpoint(where: str, url: object) -> Endpoint:
    if not isinstance(url, str):
        raise ImproperlyConfigured(f"{where}: each must be a URL (str), got {url!r}")
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    problem = ""
    if parts.scheme not in ("http", "https"):
        problem = "its scheme must be http or https"
    elif not parts.hostname:
        problem = "it names no host"
    elif port is None:
        problem = "it names no port (etcd's client port is 2379 by default)"
    elif parts.username or parts.password:
        problem = "credentials go in OPTIONS USER and PASSWORD, not in the URL"
    elif parts.path not in ("", "/") or parts.query or parts.fragment:
        problem = "it must be scheme://host:port only, without a path or query"
    if problem:
        raise ImproperlyConfigured(f"{where}: {url!r} is not a member's client URL: {problem}")
    assert parts.hostname is not None and port is not None
    return Endpoint(parts.scheme, parts.hostname, port)


def b64(text: str | bytes) -> str:
    """A key or value as the gateway takes it."""
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def range_end(prefix: str) -> str:
    """The end (exclusive) of the keys starting with `prefix`, base64: its last byte + 1."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b64(b"\0")  # every key
    raw[-1] += 1
    return b64(bytes(raw))


class _NotSent(Exception):
    """Failed before any byte of the request left: safe to send elsewhere."""


class _Failed(Exception):
    """Sent, but no good answer: it may or may not have been applied."""


class _Connection:
    """A thread's keep-alive connection to one endpoint.

    A socket timeout bounds each read, not a whole answer (a member that sends a byte now and
    then would keep a call for ever): the request and its answer run under a `Deadline`, whose
    thread cuts the socket when the call's time is up."""

    __slots__ = ("check", "deadline", "http")

    def __init__(self, endpoint: Endpoint, context: ssl.SSLContext | None) -> None:
        if endpoint.scheme == "https":
            self.http: http.client.HTTPConnection = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, context=context
            )
        else:
            self.http = http.client.HTTPConnection(endpoint.host, endpoint.port)
        self.check = SocketCheck()
        self.deadline: Deadline | None = None  # the connected socket's

    def post(self, path: str, body: bytes, headers: Mapping[str, str], until: float) -> Any:
        """The decoded JSON answer of POST `path`, within `until` (monotonic)."""
        conn = self.http
        try:
            sock = conn.sock
            if sock is not None and self._stale(sock):
                self.close()  # the member closed it (or restarted): reconnect, nothing sent
            conn.timeout = _left(until)
            if conn.sock is None:
                conn.connect()
                self.deadline = Deadline(0)
                self.deadline.attach(self.http.sock.fileno())
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise _NotSent(f"{type(exc).__name__}: {exc}") from exc
        try:
            response, data = self._exchange(path, body, headers, until)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            raise _Failed(f"{type(exc).__name__}: {exc}") from exc
        return _answer(response.status, data)

    def _exchange(
        self, path: str, body: bytes, headers: Mapping[str, str], until: float
    ) -> tuple[http.client.HTTPResponse, bytes]:
        conn, deadline = self.http, self.deadline
        assert deadline is not None
        deadline.seconds = _left(until)
        deadline.arm()
        try:
            _socket_of(conn).settimeout(_left(until))
            conn.request("POST", path, body=body, headers=headers)
            _socket_of(conn).settimeout(_left(until))
            response = conn.getresponse()
            data = response.read()
        finally:
            if deadline.disarm():
                raise TimeoutError("no whole answer within the deadline")
        return response, data

    def _stale(self, sock: Any) -> bool:
        if isinstance(sock, ssl.SSLSocket):
            return bool(sock.pending()) or self.check.readable(sock.fileno())
        return self.check.readable(sock.fileno())

    def close(self) -> None:
        deadline, self.deadline = self.deadline, None
        if deadline is not None:
            deadline.detach()  # first: the descriptor may be reused once closed
        self.http.close()


def _socket_of(conn: http.client.HTTPConnection) -> Any:
    """`conn`'s socket; closed meanwhile (the client's `close()` from another thread ends every
    thread's connections) is a ConnectionError, which the call reports as the store's."""
    sock = conn.sock
    if sock is None:
        raise ConnectionError("the connection was closed while in use")
    return sock


def _left(until: float) -> float:
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _answer(status: int, data: bytes) -> Any:
    try:
        reply = json.loads(data)
    except ValueError as exc:
        raise _Failed(f"HTTP {status}, not JSON: {data[:200]!r}") from exc
    if status != 200 or not isinstance(reply, dict) or "error" in reply:
        message = reply.get("error") or reply.get("message") if isinstance(reply, dict) else reply
        if message == NO_LEADER:
            # Refused before anything was proposed (`hasleader`): as good as never sent, so
            # even a call that may not run twice (a release) goes on to the next member.
            raise _NotSent(f"HTTP {status}: {message}")
        raise _Failed(f"HTTP {status}: {message}")
    return reply


class EtcdClient:
    """Calls to one etcd cluster through any of its `endpoints`, each within `timeout` s."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        timeout: float,
        context: ssl.SSLContext | None = None,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self.context = context
        self.credentials = credentials
        self._token: str | None = None
        self._token_mutex = threading.Lock()
        self._preferred = 0  # the endpoint that answered last
        self._threads: PerThread[dict[int, _Connection]] = PerThread(_close_all)

    def call(
        self, path: str, body: Mapping[str, Any], *, once: bool = False, within: float = 0
    ) -> Any:
        """POST `body` to `path` (e.g. "/v3/kv/txn") and return the answer; EtcdUnavailable
        when no endpoint answered in time (`within` seconds if given, else the client's
        timeout). With `once`, a request that was sent is never sent again (to another
        endpoint), as it may have been applied."""
        until = time.monotonic() + (within or self.timeout)
        payload = json.dumps(body).encode()
        count = len(self.endpoints)
        start = self._preferred
        failures: list[str] = []
        for tried in range(count):
            index = (start + tried) % count
            if time.monotonic() >= until:
                break
            # An endpoint gets its share of the time left, so a frozen member leaves time
            # for the others; a call that may not be sent twice waits for its only answer.
            share = (
                until if once else time.monotonic() + (until - time.monotonic()) / (count - tried)
            )
            try:
                reply = self._post(index, path, payload, share)
            except _NotSent as exc:
                failures.append(f"{self.endpoints[index]}: {exc}")
                continue
            except _Failed as exc:
                failures.append(f"{self.endpoints[index]}: {exc}")
                self._preferred = (index + 1) % count  # the next call starts elsewhere
                if once:
                    break
                continue
            self._preferred = index
            return reply
        tried_all = "; ".join(failures) or f"no answer within {self.timeout:g} s"
        raise EtcdUnavailable(tried_all)

    @property
    def preferred(self) -> int:
        """The index of the endpoint that answered last."""
        return self._preferred

    def call_at(self, index: int, path: str, body: Mapping[str, Any]) -> Any:
        """`call` on the endpoint `index` only."""
        until = time.monotonic() + self.timeout
        try:
            return self._post(index, path, json.dumps(body).encode(), until)
        except (_NotSent, _Failed) as exc:
            raise EtcdUnavailable(f"{self.endpoints[index]}: {exc}") from exc

    def token(self) -> str | None:
        """The auth token requests carry (None without USER); asked for when there is none."""
        if self.credentials is None:
            return None
        self.call("/v3/kv/range", {"key": b64("\0")})
        return self._token

    def _post(self, index: int, path: str, payload: bytes, until: float) -> Any:
        connections = self._threads.get()
        if connections is None:
            connections = self._threads.put({})
        conn = connections.get(index)
        if conn is None:
            conn = connections[index] = _Connection(self.endpoints[index], self.context)
        headers = dict(HEADERS)
        if self.credentials is None:
            return conn.post(path, payload, headers, until)
        headers["Authorization"] = self._auth_token(conn, until)
        try:
            return conn.post(path, payload, headers, until)
        except _Failed as exc:
            if "invalid auth token" not in str(exc):
                raise
        # Refused for its token alone (expired: nothing was applied): once more, a new one.
        self.forget_token()
        headers["Authorization"] = self._auth_token(conn, until)
        return conn.post(path, payload, headers, until)

    def _auth_token(self, conn: _Connection, until: float) -> str:
        """The token of USER/PASSWORD (asked once per client; etcd's simple tokens live 5
        minutes unused, and a refused one is dropped by `forget_token`)."""
        with self._token_mutex:
            if self._token is None:
                assert self.credentials is not None
                name, password = self.credentials
                body = json.dumps({"name": name, "password": password}).encode()
                reply = conn.post("/v3/auth/authenticate", body, HEADERS, until)
                self._token = str(reply["token"])
            return self._token

    def forget_token(self) -> None:
        with self._token_mutex:
            self._token = None

    def close(self) -> None:
        self._threads.close_all()


def _close_all(connections: dict[int, _Connection]) -> None:
    for conn in connections.values():
        conn.close()
