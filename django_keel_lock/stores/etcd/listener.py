"""Releases in other processes, heard through one etcd watch per process and store.

The watch covers every lock key of the store (`<prefix>lock/`) and asks for deletions only:
a release deletes its lock key, and so does a lease that runs out, so waiters hear of
expiries too. The gateway streams the watch as chunked HTTP, one JSON object per line; this
reads it from the socket itself, so the listener's loop can poll() the socket (a buffered
HTTP client may hold a whole event in its buffer while the socket looks idle).
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import TYPE_CHECKING, Any

from ..wakeups import ReleaseListener
from .client import HEADERS, EtcdUnavailable, b64, range_end, unb64

if TYPE_CHECKING:
    from .store import EtcdLockStore


class ChunkedLines:
    """Decodes an HTTP chunked body fed piece by piece into its lines."""

    def __init__(self) -> None:
        self.raw = b""  # not yet decoded
        self.body = b""  # decoded, not yet a whole line

    def feed(self, data: bytes) -> list[bytes]:
        self.raw += data
        while True:
            head, found, rest = self.raw.partition(b"\r\n")
            if not found:
                break
            size = int(head.split(b";")[0] or b"0", 16)
            if size == 0:
                raise ConnectionError("the watch stream ended")
            if len(rest) < size + 2:
                break
            self.body += rest[:size]
            self.raw = rest[size + 2 :]
        *lines, self.body = self.body.split(b"\n")
        return [line for line in lines if line.strip()]


class EtcdListener(ReleaseListener):
    """The store's watch: subscribing is nothing to do (every lock key is watched)."""

    store: EtcdLockStore
    #: Quiet seconds after which the member is asked whether it still has a leader.
    ping_after = 3.0

    def __init__(self, store: EtcdLockStore) -> None:
        super().__init__(store)
        self._sock: socket.socket | None = None
        self._lines = ChunkedLines()
        self._endpoint = 0

    def connect(self) -> bool:
        client = self.store.client
        count = len(client.endpoints)
        failures = []
        for tried in range(count):
            index = (client.preferred + tried) % count
            try:
                self._open(index)
            except OSError as exc:
                failures.append(f"{client.endpoints[index]}: {exc}")
                continue
            self._endpoint = index
            return True
        raise ConnectionError("; ".join(failures))

    def _open(self, index: int) -> None:
        client = self.store.client
        endpoint = client.endpoints[index]
        sock = socket.create_connection((endpoint.host, endpoint.port), client.timeout)
        if endpoint.scheme == "https":
            assert client.context is not None
            sock = client.context.wrap_socket(sock, server_hostname=endpoint.host)
        prefix = self.store.lock_name("")
        body = json.dumps(
            {
                "create_request": {
                    "key": b64(prefix),
                    "range_end": range_end(prefix),
                    "filters": ["NOPUT"],
                }
            }
        ).encode()
        headers = {**HEADERS, "Host": f"{endpoint.host}:{endpoint.port}"}
        token = client.token()
        if token is not None:
            headers["Authorization"] = token
        request = ["POST /v3/watch HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        request.append(f"Content-Length: {len(body)}")
        sock.sendall(("\r\n".join(request) + "\r\n\r\n").encode() + body)
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            if not data:
                raise ConnectionError("the member closed the watch")
            head += data
        head, _, rest = head.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            sock.close()
            raise ConnectionError(f"the watch was refused: {head.splitlines()[0]!r}")
        sock.setblocking(False)
        self._sock, self._lines = sock, ChunkedLines()
        self._pending = rest

    def prepare(self) -> bool:
        self.dispatch(False)  # what came with the headers
        return False  # ready once etcd says the watch is created

    def socket(self) -> int:
        if self._sock is None:
            raise ConnectionError("no watch")
        return self._sock.fileno()

    def subscribe(self, keys: list[str]) -> None:
        pass

    def unsubscribe(self, keys: list[str]) -> None:
        pass

    def ping(self) -> None:
        """A linearizable read on the watch's member: it fails (and the watch is made again,
        maybe elsewhere) when the member lost its leader or stopped answering."""
        try:
            self.store.client.call_at(self._endpoint, "/v3/kv/range", {"key": b64("\0")})
        except EtcdUnavailable as exc:
            raise ConnectionError(str(exc)) from exc

    def dispatch(self, data: bool) -> None:
        received = self._pending
        self._pending = b""
        if data:
            assert self._sock is not None
            received += self._read()
        if not received:
            return
        for line in self._lines.feed(received):
            self._handle(json.loads(line))

    def _read(self) -> bytes:
        assert self._sock is not None
        chunks: list[bytes] = []
        while True:
            try:
                chunk = self._sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                break
            if not chunk:
                if chunks:
                    break
                raise ConnectionError("the member closed the watch")
            chunks.append(chunk)
        return b"".join(chunks)

    def _handle(self, message: Any) -> None:
        result = message.get("result") if isinstance(message, dict) else None
        if result is None:
            raise ConnectionError(f"the watch failed: {message!r}")
        if result.get("canceled"):
            raise ConnectionError(f"etcd cancelled the watch: {result.get('cancel_reason')}")
        if result.get("created"):
            self.connected()
        cut = len(self.store.lock_name(""))
        for event in result.get("events") or []:
            if event.get("type") == "DELETE":
                self.store.wake_board.wake(unb64(event["kv"]["key"])[cut:])

    def disconnect(self) -> None:
        sock, self._sock = self._sock, None
        self._pending = b""
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    _pending = b""
