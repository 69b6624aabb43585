"""The database store under faults: a frozen server never hangs a call (SOCKET_TIMEOUT), and a
release that returned True is never undone by an extend that raced it."""

from __future__ import annotations

import linecache
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test import override_settings

from django_keel_lock import LockStoreUnavailable, lock
from django_keel_lock.checks import check_stores
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.connections import SOCKET_DEADLINES, Deadline
from django_keel_lock.stores.database.dialects.postgresql import notify_channel
from django_keel_lock.stores.database.listener import MariaDBListener, PostgresListener

from .conftest import (
    DATABASE_STORES,
    SERVER_DATABASES,
    database_like,
    database_of,
    needs_store,
    serving,
    store_params,
)
from .support.redis_servers import FaultyProxy
from .support.threads import waiting_in_thread

T = TypeVar("T")

#: The SOCKET_TIMEOUT of the stores behind a frozen proxy, and how long a call may then take.
TIMEOUT = 2
WITHIN = 4.0


@pytest.fixture(params=store_params(SERVER_DATABASES))
def server_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextmanager
def behind_proxy(alias: str, **options: Any) -> Iterator[tuple[DatabaseLockStore, FaultyProxy]]:
    """A store (registered under its alias) on the database of the store `alias`, reached
    through a FaultyProxy, with these OPTIONS. The proxy is no pooler: said so
    (TRANSACTION_POOLER: False), as a project behind a plain TCP proxy says it, or the store
    would take it for one (stores.md, Behind a pooler)."""
    database = database_of(alias)
    proxy = FaultyProxy(int(connections.settings[database]["PORT"]))
    name = f"{database}-proxied-{uuid.uuid4().hex[:8]}"
    try:
        with database_like(database, name, HOST="127.0.0.1", PORT=proxy.port) as through:
            options = {"TRANSACTION_POOLER": False, **options}
            store = DatabaseLockStore(name, {"DATABASE": through, **options})
            with serving(store):
                yield store, proxy
    finally:
        proxy.close()


def wait_until(condition: Callable[[], object], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def timed(call: Callable[[], T]) -> tuple[T | BaseException, float]:
    """(what `call` returned or raised, seconds it took)."""
    started = time.monotonic()
    try:
        outcome: T | BaseException = call()
    except BaseException as exc:
        outcome = exc
    return outcome, time.monotonic() - started


def assert_unavailable_within(outcome: tuple[Any, float], what: str, match: str = "") -> None:
    result, took = outcome
    assert isinstance(result, LockStoreUnavailable), f"{what} gave {result!r} after {took:.1f}s"
    assert took < WITHIN, f"{what} took {took:.1f}s (SOCKET_TIMEOUT {TIMEOUT})"
    assert match in str(result), str(result)


# -- a frozen server: SOCKET_TIMEOUT ----------------------------------------------------------


def test_frozen_server_fails_each_call_within_the_socket_timeout_and_release_can_be_retried(
    server_alias: str, key: str
) -> None:
    """PostgreSQL or MariaDB stops answering (the proxy holds every byte, closes nothing):
    acquire, is_locked and release each raise LockStoreUnavailable within WITHIN seconds, on a
    connection that was open (the statement gets no reply: the libpq path, the cursor path) or
    a new one (connecting gets none). The handle keeps its owner; once the server answers
    again, the release goes through."""
    with behind_proxy(server_alias, SOCKET_TIMEOUT=TIMEOUT) as (store, proxy):
        held = lock(key, ttl=30, store=store.alias)
        other = lock(key, store=store.alias)
        with ThreadPoolExecutor(1) as releaser, ThreadPoolExecutor(1) as reader:
            # Each thread's connection open, every hot statement prepared.
            assert held.acquire() and not other.acquire()
            assert reader.submit(held.is_locked).result() is True
            warm_up = lock(f"{key}:warm-up", store=store.alias)
            assert releaser.submit(warm_up.run, int).result() == (True, 0)
            owner = held.owner
            proxy.mode = "stall"

            on_open = "no reply within 2s (OPTIONS SOCKET_TIMEOUT)"
            assert_unavailable_within(timed(lambda: other.acquire(timeout=1)), "acquire", on_open)
            assert store._threads.get() is None, "the connection that timed out was kept"
            assert_unavailable_within(reader.submit(timed, held.is_locked).result(), "get", on_open)
            release = releaser.submit(timed, held.release).result()
            assert_unavailable_within(release, "release", on_open)
            assert held.held and held.owner == owner and not held.lost
            # This thread's connection went with its timeout: the next call connects anew.
            assert_unavailable_within(timed(held.is_locked), "is_locked", "cannot connect")
            assert_unavailable_within(timed(held.release), "release", "cannot connect")
            assert held.held and held.owner == owner and not held.lost

            proxy.drop_connections()
            proxy.mode = "pass"
            assert releaser.submit(held.release).result() is True
            assert not held.held and not held.lost
            assert store.get(key) is None
            assert other.acquire() and other.release()


def test_a_late_reply_does_not_hang_the_call_and_the_release_lands_once(
    server_alias: str, key: str
) -> None:
    """The proxy freezes and then delivers what it held: the release that timed out still
    reaches the server. Retried, it finds the lock already released (False) or releases it
    (True), whichever came first; the key ends free either way, and nothing hangs."""
    with behind_proxy(server_alias, SOCKET_TIMEOUT=TIMEOUT) as (store, proxy):
        held = lock(key, ttl=30, store=store.alias)
        assert held.acquire()
        proxy.mode = "stall"
        assert_unavailable_within(timed(held.release), "release", "SOCKET_TIMEOUT")
        proxy.mode = "pass"
        outcome, took = timed(held.release)
        assert outcome in (True, False) and took < WITHIN, (outcome, took)
        assert wait_until(lambda: store.get(key) is None, 5)


@pytest.mark.parametrize(
    ("alias", "listener", "quiet"),
    [
        pytest.param("postgres", PostgresListener, "ping_after", marks=needs_store("postgres")),
        pytest.param("mariadb", MariaDBListener, "nap", marks=needs_store("mariadb")),
    ],
)
def test_frozen_server_turns_the_listener_off_and_it_comes_back(
    key: str, monkeypatch: pytest.MonkeyPatch, alias: str, listener: type, quiet: str
) -> None:
    """The listener's connection proves itself alive after `quiet` seconds (PostgreSQL's
    ping after `ping_after` quiet seconds; the reply of MariaDB's nap): a frozen server's
    missing reply must clear `ready` (waiters then poll) within SOCKET_TIMEOUT more, not block
    the listener for good; once the server answers, the listener reconnects."""
    monkeypatch.setattr(listener, quiet, 0.3)
    with behind_proxy(alias, SOCKET_TIMEOUT=1) as (store, proxy):
        with store.watch(key):
            assert wait_until(lambda: store.push_wakeups, 10), "the listener never connected"
            proxy.mode = "stall"
            frozen = time.monotonic()
            assert wait_until(lambda: not store.push_wakeups, 5), "listener still trusted"
            assert time.monotonic() - frozen < 0.3 + 1 + 1.5
            proxy.drop_connections()
            proxy.mode = "pass"
            assert wait_until(lambda: store.push_wakeups, 10), "the listener did not reconnect"
        _, took = timed(store.close)
        assert took < 3.5, f"closing took {took:.1f}s"


def test_socket_timeout_bounds_connecting_in_whole_seconds(server_alias: str) -> None:
    """The drivers take connect_timeout in whole seconds: SOCKET_TIMEOUT rounded up, or the
    project's own connect_timeout if that is shorter."""
    database = database_of(server_alias)

    def connect_timeout(socket_timeout: float, **options: Any) -> Any:
        with database_like(database, f"{database}-ct", OPTIONS=options) as name:
            store = DatabaseLockStore("ct", {"DATABASE": name, "SOCKET_TIMEOUT": socket_timeout})
            return store._connection_settings()["OPTIONS"]["connect_timeout"]

    assert connect_timeout(5) == 5
    assert connect_timeout(1.5) == 2
    assert connect_timeout(0.2) == 1  # libpq makes that 2 s: it waits at least 2
    assert connect_timeout(5, connect_timeout=3) == 3
    assert connect_timeout(2, connect_timeout=10) == 2


def test_socket_timeout_defaults_to_five_seconds() -> None:
    assert DatabaseLockStore("d", {"DATABASE": "default"}).socket_timeout == 5.0
    assert (
        DatabaseLockStore("d", {"DATABASE": "default", "SOCKET_TIMEOUT": 0.5}).socket_timeout == 0.5
    )
    store = DatabaseLockStore("d", {"DATABASE": "default", "SOCKET_TIMEOUT": "1500ms"})
    assert store.socket_timeout == 1.5


# Durations as `ttl` takes them: "1500ms" is one, "soon" is not.
BAD_TIMEOUTS = [0, -1, "soon", None, True, float("nan"), float("inf"), [5]]


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
def test_socket_timeout_that_is_not_a_positive_number_is_refused(value: Any) -> None:
    with pytest.raises(
        ImproperlyConfigured,
        match=r"KEEL_LOCK_STORES\['bad'\] OPTIONS SOCKET_TIMEOUT (must be|could not be parsed)",
    ):
        DatabaseLockStore("bad", {"DATABASE": "default", "SOCKET_TIMEOUT": value})


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize(
    ("backend", "options"),
    [("DatabaseLockStore", {}), ("RedisLockStore", {"URL": "redis://127.0.0.1:6379/9"})],
    ids=["database", "redis"],
)
def test_e010_socket_timeout_that_is_not_a_positive_number(
    value: Any, backend: str, options: dict[str, Any]
) -> None:
    stores = {
        "default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"},
        "bad": {
            "BACKEND": f"django_keel_lock.stores.{backend}",
            "OPTIONS": {**options, "SOCKET_TIMEOUT": value},
        },
    }
    with override_settings(KEEL_LOCK_STORES=stores):
        found = check_stores()
    assert [m.id for m in found] == ["django_keel_lock.E010"]
    assert found[0].msg.startswith("KEEL_LOCK_STORES['bad'] OPTIONS SOCKET_TIMEOUT ")


def test_sqlite_accepts_a_socket_timeout_and_has_nothing_to_cut(key: str) -> None:
    """SQLite has no server: SOCKET_TIMEOUT is accepted (one settings shape for every
    database) and no call is cut, however short it is."""
    store = DatabaseLockStore("sqlite-timeout", {"DATABASE": "default", "SOCKET_TIMEOUT": 1e-6})
    try:
        for _ in range(3):
            assert store.acquire(key, "a" * 32, "h", 30).acquired
            assert store.get(key) is not None
            assert store.release(key, "a" * 32)
    finally:
        store.close()


def test_deadline_cuts_only_the_call_that_outlived_it() -> None:
    """A read still blocked when its deadline passes is cut (EOF, at once); a call that ended
    in time leaves its socket alone, however long after its deadline the socket is used."""
    mine, server = socket.socketpair()
    with mine, server:
        deadline = Deadline(0.2)
        deadline.attach(mine.fileno())
        try:
            deadline.arm()
            server.sendall(b"x")
            assert mine.recv(1) == b"x"
            assert deadline.disarm() is False
            time.sleep(0.4)  # well past that call's deadline
            server.sendall(b"y")
            assert mine.recv(1) == b"y", "a finished call's socket was cut"

            deadline.arm()
            started = time.monotonic()
            assert mine.recv(1) == b"", "the blocked read was not cut"
            assert 0.15 < time.monotonic() - started < 1.0
            assert deadline.disarm() is True
        finally:
            deadline.detach()


def test_a_forked_child_watches_none_of_the_parents_sockets() -> None:
    """After fork() the parent's sockets are shared with the child: the child's deadline
    thread must never cut them, so it starts with none."""
    mine, server = socket.socketpair()
    with mine, server:
        deadline = Deadline(30)
        deadline.attach(mine.fileno())
        try:
            pid = os.fork()
            if pid == 0:  # the child
                os._exit(0 if not list(SOCKET_DEADLINES._deadlines) else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert deadline in set(SOCKET_DEADLINES._deadlines)
        finally:
            deadline.detach()


# -- a release that returned True stays released ----------------------------------------------

#: Races per database. SQLite runs one writer at a time (the race cannot happen there): fewer
#: rounds keep the same contract checked without its slow commits dominating the run.
RACES = {"sqlite": 500, "postgres": 2000, "mariadb": 2000}


def spin(seconds: float) -> None:
    """Busy-wait `seconds` (sleep() is too coarse for a fraction of a millisecond)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("alias", store_params(DATABASE_STORES))
def test_extend_racing_a_release_never_brings_the_released_lock_back(alias: str) -> None:
    """Release and extend of one owner's lock, sent at nearly the same moment from two threads,
    RACES times: after every release that returned True the key is free. (MariaDB reads its clock
    once per statement: an extend that started before the release but reached the row after it
    used to find the released row "still valid" and extend it by its ttl.)"""
    store = DatabaseLockStore(f"race-{alias}", {"DATABASE": database_of(alias)})
    owner, prefix, races = "o" * 32, f"race:{uuid.uuid4().hex[:12]}", RACES[alias]
    keys = [f"{prefix}:{n}" for n in range(races)]
    released: list[bool] = [False] * races
    errors: list[BaseException] = []
    start = threading.Barrier(2, timeout=30)

    def racer(release: bool) -> None:
        try:
            for n, key in enumerate(keys):
                start.wait()
                if release:
                    released[n] = store.release(key, owner)
                else:
                    spin(n % 30 * 0.0001)  # the release got ahead by 0 to 3 ms: its commit
                    store.extend(key, owner, 60)
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    try:
        for key in keys:
            assert store.acquire(key, owner, "racer", 60).acquired
        threads = [threading.Thread(target=racer, args=(side,)) for side in (True, False)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        assert all(released), "a release that raced an extend of its own lock found no lock"
        held = [key for key in keys if store.get(key) is not None]
        assert not held, f"{len(held)} of {races} keys released with True are still held"
        taken = [key for key in keys if not store.acquire(key, "n" * 32, "next", 1).acquired]
        assert not taken, f"{len(taken)} of {races} keys released with True cannot be acquired"
    finally:
        store.close()


@needs_store("postgres")
def test_a_postgres_listener_that_stops_while_a_waiting_thread_reads_its_connection_ends_that_read(
    key: str,
) -> None:
    # A thread waiting for a key reads the listener's connection itself (`read_here`). The
    # listener giving that connection up (stopped here; or a dead link) closes it once that
    # thread has stopped reading (libpq: one thread at a time), and the thread then sleeps what
    # is left of its wait, not all of it again.
    store = DatabaseLockStore("pg-reading", {"DATABASE": "postgres"})
    try:
        with store.watch(key):
            assert wait_until(store.listener_ready, 10), "the listener never connected"
        listener = store._listener
        assert isinstance(listener, PostgresListener)
        raw = listener._raw
        thread, waited = waiting_in_thread(store, key, 4.0)
        assert wait_until(listener._reading.locked, 10), "the waiting thread never read"
        time.sleep(1.0)
        store.stop_listener()
        assert raw.closed, "the listener left its connection open"
        thread.join(10)
        assert waited and waited[0] < 5.0, waited  # 4 s asked; 5 s when it slept 4 s again
    finally:
        store.close()


class _Interrupted(Exception):
    """What a signal handler raises in a waiting thread (a task's soft time limit)."""


def _raising_after(call: str) -> Callable[[Any, str, Any], Any]:
    """A trace function that raises `_Interrupted` in `PostgresListener.dispatch` at the first
    line after the one that calls `call` (of libpq), as a signal handler raising there would."""

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not PostgresListener.dispatch.__code__:
            return None
        after = False

        def line(frame: Any, event: str, arg: Any) -> Any:
            nonlocal after
            if event == "line" and after:
                sys.settrace(None)
                raise _Interrupted
            if event == "line":
                source = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                after = f"pgconn.{call}" in source
            return line

        return line

    return trace


@needs_store("postgres")
@pytest.mark.parametrize("call", ["consume_input", "notifies"])
@pytest.mark.parametrize("then", ["the same thread reads again", "the listener's thread reads"])
def test_a_wake_up_read_by_a_waiting_thread_that_a_signal_interrupts_still_wakes_its_waiter(
    key: str, call: str, then: str
) -> None:
    # A waiting thread reads the listener's connection itself (`read_here`); an exception
    # raised there by a signal handler (a task's time limit) right after libpq read the socket
    # (what it read is in libpq's buffer, the socket empty), or right after a notification was
    # taken off libpq: the wake-up of another key still reaches its waiter at once, not at the
    # listener's next ping (5 s) or never, whoever reads next (a waiting thread, or the
    # listener's own where the other key's waiter is a callback, as a task's, that reads
    # nothing).
    from .test_database_line import postgres_connection

    store = DatabaseLockStore("pg-interrupted", {"DATABASE": "postgres"})
    other = key + ":other"
    woken = threading.Event()
    try:
        with (
            store.watch(key) as waiter,
            store.watch(other) as waiter_of_other,
            store.watch_many([other], lambda _: woken.set()),
        ):
            listener = store._listener
            assert isinstance(listener, PostgresListener)
            subscribed = lambda: {key, other} <= listener.subscribed  # noqa: E731
            assert wait_until(lambda: store.listener_ready() and subscribed(), 10)
            waiter.poll()  # each new subscription woke its key once
            waiter_of_other.poll()
            time.sleep(0.1)
            woken.clear()
            with postgres_connection() as raw:
                notify = f"SELECT pg_notify('{notify_channel(other)}', %s)"
                timer = threading.Timer(0.5, raw.execute, (notify, (other,)))
                timer.start()
                sys.settrace(_raising_after(call))
                try:
                    with pytest.raises(_Interrupted):
                        waiter.wait(3.0)
                finally:
                    sys.settrace(None)
                    timer.join()
            if then == "the same thread reads again":
                assert waiter_of_other.wait(1.0), "the wake-up read before the signal was lost"
            else:
                assert woken.wait(1.0), "the wake-up read before the signal was lost"
    finally:
        store.close()


@needs_store("postgres")
@pytest.mark.parametrize("reader", ["the listener's thread", "a waiting thread"])
def test_a_malformed_grant_notification_is_skipped_and_the_listener_keeps_its_connection(
    key: str, reader: str
) -> None:
    # Anyone who may NOTIFY can send a payload on this process's grant channel that is no
    # grant: it is skipped (logged), the wake-up after it still wakes its waiter, and the
    # listener keeps its connection (no reconnection, no waking of every waiter).
    from django_keel_lock.stores.database.dialects.postgresql import grant_channel

    from .test_database_line import postgres_connection

    store = DatabaseLockStore("pg-malformed", {"DATABASE": "postgres"})
    woken = threading.Event()
    try:
        with store.watch(key) as waiter, store.watch_many([key], lambda _: woken.set()):
            listener = store._listener
            assert isinstance(listener, PostgresListener)
            assert wait_until(lambda: store.listener_ready() and key in listener.subscribed, 10)
            pid = listener.backend_pid
            time.sleep(0.1)
            waiter.poll()  # the subscription woke the key once
            woken.clear()
            with postgres_connection() as raw:
                sent = [(grant_channel(listener.address), "no grant"), (notify_channel(key), key)]
                send = lambda: [raw.execute("SELECT pg_notify(%s, %s)", n) for n in sent]  # noqa: E731
                timer = threading.Timer(0.3, send)
                timer.start()
                if reader == "a waiting thread":
                    assert waiter.wait(2.0), "the wake-up after the malformed grant was lost"
                else:
                    assert woken.wait(2.0), "the wake-up after the malformed grant was lost"
                timer.join()
            assert listener.backend_pid == pid and store.listener_ready()
    finally:
        store.close()


@needs_store("postgres")
def test_a_waiting_thread_that_reads_the_listeners_connection_does_not_put_off_its_ping(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A waiting thread that reads the listener's connection (`read_here`) pokes the listener's
    # thread each time it begins, so that it stops reading; a poke is no reply from the
    # server. With a thread waiting again and again, a frozen server must still clear `ready`
    # (waiters then poll) within `ping_after` + SOCKET_TIMEOUT, as with nobody waiting.
    monkeypatch.setattr(PostgresListener, "ping_after", 0.3)
    stop = threading.Event()
    with behind_proxy("postgres", SOCKET_TIMEOUT=1) as (store, proxy):

        def keep_waiting() -> None:
            with store.watch(key) as waiter:
                while not stop.is_set():
                    waiter.wait(0.1)

        thread = threading.Thread(target=keep_waiting)
        thread.start()
        try:
            assert wait_until(lambda: store.push_wakeups, 10), "the listener never connected"
            listener = store._listener
            assert listener is not None
            assert wait_until(listener._reading.locked, 10), "the waiting thread never read"
            proxy.mode = "stall"
            frozen = time.monotonic()
            assert wait_until(lambda: not store.push_wakeups, 5), "listener still trusted"
            assert time.monotonic() - frozen < 0.3 + 1 + 1.5
        finally:
            stop.set()
            thread.join(10)
            proxy.drop_connections()
            proxy.mode = "pass"
