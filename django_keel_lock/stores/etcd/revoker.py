"""Lease revocations of an etcd store, on threads of their own.

A lease no key uses any more (after a release, a refused acquire, an extend) is revoked in the
background: nothing waits for it, and if it fails the lease runs out by itself. Not on the
store's worker threads: those run the async calls, and a slow etcd would keep them busy with
revocations while an `aacquire` waited behind them past SOCKET_TIMEOUT. The threads are
daemons: at exit, what is still queued is left to run out.
"""

from __future__ import annotations

import os
import queue
import threading

from .client import EtcdClient, EtcdUnavailable

#: The most lease revocations queued at once; beyond them leases run out by themselves.
MAX_REVOKING = 16
#: Revocations run at once (each waits at most 1 s for etcd).
THREADS = 2


class Revoker:
    """Revokes the leases `put` to it through `client`, on THREADS daemon threads of this
    process (started on first use, and again in a forked child)."""

    def __init__(self, client: EtcdClient, alias: str) -> None:
        self.client = client
        self.alias = alias
        self._mutex = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue(MAX_REVOKING)
        self._pid = -1  # the process whose threads serve `_queue`

    def put(self, lease: str) -> None:
        """Revoke `lease` soon, unless MAX_REVOKING wait already (then it runs out alone)."""
        self._start()
        try:
            self._queue.put_nowait(lease)
        except queue.Full:
            pass

    def _start(self) -> None:
        if self._pid == os.getpid():
            return
        with self._mutex:
            if self._pid == os.getpid():
                return
            self._queue = queue.Queue(MAX_REVOKING)  # a parent's queue is the parent's
            for number in range(THREADS):
                threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name=f"keel-lock-revoke-{self.alias}-{number}",
                    daemon=True,
                ).start()
            self._pid = os.getpid()

    def _run(self, leases: queue.Queue[str | None]) -> None:
        while (lease := leases.get()) is not None:
            try:
                self.client.call(
                    "/v3/lease/revoke", {"ID": lease}, within=min(1.0, self.client.timeout)
                )
            except EtcdUnavailable:
                pass  # it runs out on its own

    def close(self) -> None:
        """Let this process's threads end once they are idle."""
        with self._mutex:
            if self._pid != os.getpid():
                return
            self._pid = -1
            for _ in range(THREADS):
                try:
                    self._queue.put_nowait(None)
                except queue.Full:
                    break  # busy: they end with the process
