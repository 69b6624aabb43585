"""A TCP proxy that counts round trips: how many times a client sent something after the
server last answered it (however many writes or pipelined commands each is), per connection.
Any protocol: Redis, PostgreSQL. The count is what the client's own connections did, whatever
else the server is doing."""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RoundTrips:
    """A proxy on a free port of 127.0.0.1 forwarding to `host`:`port` (`start`, `stop`);
    `count` is the round trips of every connection through it so far."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.count = 0
        self._mutex = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> RoundTrips:
        self._spawn(self._accept)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(5)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._spawn(self._pump, client, server)

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        """Forward both ways; a round trip starts when the client sends after the server."""
        answered = True
        with selectors.DefaultSelector() as selector, client, server:
            selector.register(client, selectors.EVENT_READ, server)
            selector.register(server, selectors.EVENT_READ, client)
            while not self._stopping.is_set():
                for ready, _ in selector.select(0.2):
                    source: socket.socket = ready.fileobj  # type: ignore[assignment]
                    try:
                        data = source.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    if source is client and answered:
                        with self._mutex:
                            self.count += 1
                    answered = source is server
                    ready.data.sendall(data)


@contextmanager
def round_trips(host: str, port: int) -> Iterator[RoundTrips]:
    proxy = RoundTrips(host, port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
