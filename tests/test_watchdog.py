"""auto_extend: the watchdog keeps a lock alive while held, stops with its holder, caps at
max_hold, and reports a lock lost (flag, signal, WARNING, ensure_held) when it is."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connections

from django_keel_lock import Lock, LockNotHeldError, get_lock_store, lock, set_lock_store, signals
from django_keel_lock.stores import LockStore
from django_keel_lock.stores.database import DatabaseLockStore
from django_keel_lock.stores.redis import RedisLockStore

from . import settings
from .conftest import store_params
from .support.redis_servers import FaultyProxy, RedisServer

# This run's own name: the outage tests end a proxied store's sessions on the server by it,
# and another run (CI's second pass, on the same server) must keep its own.
PROXIED = f"keel-lock-behind-proxy-{settings.RUN_ID}-{os.getpid()}"
TTL = 1.0
# Renewal is store-independent beyond store.extend (which the contract suite covers): one
# per-process store, one through worker threads, one native async.
RENEWAL_STORES = store_params(
    ["memory", "postgres", "redis"]
)  # renewals every 0.33 s: room for a slow store on a busy machine


def watchdog_threads(key: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"keel-lock-watchdog:{key[:40]}"]


def watchdog_tasks(key: str) -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == f"keel-lock-watchdog:{key[:40]}"]


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def lost_events() -> Iterator[list[tuple[Lock, str]]]:
    events: list[tuple[Lock, str]] = []

    def on_lost(sender: Any, lock: Lock, reason: str, **kwargs: Any) -> None:
        events.append((lock, reason))

    signals.lock_lost.connect(on_lost)
    yield events
    signals.lock_lost.disconnect(on_lost)


# -- arguments ----------------------------------------------------------------------------


def test_watchdog_arguments_are_validated_with_clear_errors(key: str) -> None:
    with pytest.raises(TypeError, match="auto_extend must be True or False"):
        lock(key, store="memory", auto_extend="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_hold caps how long auto_extend"):
        lock(key, store="memory", max_hold=60)
    with pytest.raises(ValueError, match="max_hold must be > 0"):
        lock(key, store="memory", auto_extend=True, max_hold=-1)
    with pytest.raises(ValueError, match="max_hold could not be parsed"):
        lock(key, store="memory", auto_extend=True, max_hold="soon")
    handle = lock(key, store="memory", auto_extend=True, max_hold="5m")
    assert handle.auto_extend and handle.max_hold == 300.0


# -- sync: a thread per held lock ---------------------------------------------------------


@pytest.mark.parametrize("alias", RENEWAL_STORES)
def test_auto_extend_keeps_the_lock_past_its_ttl_and_stops_on_release(alias: str, key: str) -> None:
    def make_lock(**kwargs: Any) -> Lock:
        return lock(key, store=alias, **kwargs)

    handle = make_lock(ttl=TTL, auto_extend=True)
    assert handle.acquire()
    assert len(watchdog_threads(key)) == 1
    time.sleep(2.3 * TTL)
    handle.ensure_held()
    assert not handle.is_expired() and not handle.lost
    assert not make_lock().acquire()
    assert handle.release()
    assert wait_until(lambda: not watchdog_threads(key), 1.0), "watchdog outlived the release"
    assert make_lock().acquire()


def test_without_auto_extend_the_same_lock_expires(key: str) -> None:
    handle = lock(key, store="memory", ttl=TTL)
    assert handle.acquire()
    assert not watchdog_threads(key)
    time.sleep(1.3 * TTL)
    assert handle.is_expired()
    with pytest.raises(LockNotHeldError, match="it was lost"):
        handle.ensure_held()


@pytest.mark.parametrize("alias", store_params(["memory", "postgres"]))
def test_watchdog_stops_when_the_handle_is_garbage_collected(alias: str, key: str) -> None:
    handle = lock(key, store=alias, ttl=TTL, auto_extend=True)
    assert handle.acquire()
    assert watchdog_threads(key)
    del handle
    gc.collect()
    assert wait_until(lambda: not watchdog_threads(key), 1.0), "watchdog kept a dead handle"
    other = lock(key, store=alias)
    assert wait_until(other.acquire, 2 * TTL), "the lock was still being extended"
    other.release()


def test_lost_when_an_extend_finds_the_lock_taken_over(
    make_lock: Callable[..., Lock],
    store: LockStore,
    key: str,
    lost_events: list[tuple[Lock, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    handle = make_lock(ttl=TTL, auto_extend=True)
    assert handle.acquire()
    assert store.force_release(key) is not None
    thief = make_lock(ttl=30)
    assert thief.acquire()
    with caplog.at_level(logging.WARNING, logger="django_keel_lock"):
        assert wait_until(lambda: handle.lost, 2 * TTL), "the watchdog did not notice"
    assert [(lk, "taken over" in why) for lk, why in lost_events] == [(handle, True)]
    assert any(r.levelno == logging.WARNING and "was lost" in r.message for r in caplog.records)
    assert not handle.held
    with pytest.raises(LockNotHeldError, match="it was lost"):
        handle.ensure_held()
    assert wait_until(lambda: not watchdog_threads(key), 1.0)
    assert handle.release() is False and len(lost_events) == 1
    info = thief.info()
    assert info is not None and info.owner == thief.owner  # the thief was left alone
    thief.release()


@pytest.mark.parametrize("alias", store_params(["memory", "postgres"]))
def test_max_hold_caps_how_long_the_watchdog_keeps_the_lock(
    alias: str, key: str, lost_events: list[tuple[Lock, str]]
) -> None:
    handle = lock(key, store=alias, ttl=TTL, auto_extend=True, max_hold=2.2 * TTL)
    started = time.monotonic()
    assert handle.acquire()
    time.sleep(1.6 * TTL)
    assert not handle.is_expired(), "expired before max_hold"
    other = lock(key, store=alias)
    assert wait_until(other.acquire, 3 * TTL)
    freed = time.monotonic() - started
    assert 2.1 * TTL < freed < 2.2 * TTL + 0.6, freed
    assert wait_until(lambda: bool(lost_events), 1.0)
    assert lost_events[0][0] is handle and "max_hold" in lost_events[0][1]
    other.release()


def test_ensure_held_without_watchdog_fails_once_the_ttl_ran_out(
    key: str, lost_events: list[tuple[Lock, str]]
) -> None:
    handle = lock(key, store="memory", ttl=0.3)
    assert handle.acquire()
    handle.ensure_held()
    time.sleep(0.4)
    for _ in range(2):
        with pytest.raises(LockNotHeldError):
            handle.ensure_held()
    assert handle.lost and len(lost_events) == 1


# -- store outages ------------------------------------------------------------------------


def cut_proxy(proxy: FaultyProxy) -> None:
    """New connections through `proxy` are refused and open ones are dropped."""
    # shutdown() wakes the accept() that close() alone leaves blocked (which would let one
    # more connection through); the server side then drops what is still open.
    try:
        proxy._listener.shutdown(socket.SHUT_RDWR)
    except OSError:  # cut already
        pass
    proxy.close()
    config = connections["postgres"].settings_dict
    # A connection of its own, closed at once: nothing left to keep the test database busy.
    with psycopg.connect(
        host=config["HOST"],
        port=config["PORT"],
        user=config["USER"],
        dbname=config["NAME"],
        autocommit=True,
    ) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            [PROXIED],
        )


@contextmanager
def postgres_behind(proxy: FaultyProxy) -> Iterator[str]:
    """A lock store alias on the test PostgreSQL database, reached through `proxy`."""
    config = dict(connections["postgres"].settings_dict)
    config.update(PORT=proxy.port, OPTIONS={**config["OPTIONS"], "application_name": PROXIED})
    # An alias per proxy: Django caches a connection object per alias in each thread.
    alias = f"pg-proxy-{proxy.port}"
    connections.settings[alias] = config
    store = DatabaseLockStore(alias=alias, options={"DATABASE": alias})
    set_lock_store(store, alias)
    try:
        yield alias
    finally:
        cut_proxy(proxy)  # first: frees any worker stuck on a stalled connection
        set_lock_store(None, alias)
        store.close()
        del connections.settings[alias]


@contextmanager
def outage(kind: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """(alias, cut): a store that works until `cut()` breaks it for real."""
    if kind.startswith("postgres"):
        proxy = FaultyProxy(int(connections["postgres"].settings_dict["PORT"]))

        def cut() -> None:
            if kind == "postgres-stall":
                proxy.mode = "stall"  # packets stop, nothing is closed: calls hang
            else:
                cut_proxy(proxy)

        with postgres_behind(proxy) as alias:
            yield alias, cut
        return
    server = RedisServer().start()
    store = RedisLockStore(
        alias="redis-outage", options={"URL": server.url + "?socket_timeout=0.5"}
    )
    set_lock_store(store, "redis-outage")
    try:
        yield "redis-outage", server.kill
    finally:
        set_lock_store(None, "redis-outage")
        store.close()
        server.stop()


OUTAGES = [
    *store_params(["postgres"]),
    pytest.param("postgres-stall", id="postgres-stall", marks=store_params(["postgres"])[0].marks),
    *store_params(["redis"]),
]


@pytest.mark.parametrize("kind", OUTAGES)
def test_store_outage_during_renewal_marks_the_lock_lost_after_its_ttl(
    kind: str, key: str, lost_events: list[tuple[Lock, str]], caplog: pytest.LogCaptureFixture
) -> None:
    with outage(kind) as (alias, cut):
        handle = lock(key, store=alias, ttl=TTL, auto_extend=True)
        assert handle.acquire()
        time.sleep(0.5 * TTL)  # one renewal has gone through
        cut()
        cut_at = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="django_keel_lock"):
            assert wait_until(lambda: handle.lost, 3 * TTL), "outage never reported"
        noticed = time.monotonic() - cut_at
        # Not before the last confirmed expiry, and promptly after it.
        assert 0.3 * TTL < noticed < 1.0 * TTL + 0.5, noticed
        # `lost` is set before the signal goes out, from the watchdog's thread: wait for it.
        assert wait_until(lambda: lost_events, 1.0)
        assert len(lost_events) == 1 and "ttl ran out" in lost_events[0][1]
        assert any("was lost" in r.message for r in caplog.records)
        with pytest.raises(LockNotHeldError):
            handle.ensure_held()
        assert wait_until(lambda: not watchdog_threads(key), 1.0)


# -- async: a task per held lock ----------------------------------------------------------


@pytest.mark.parametrize("alias", RENEWAL_STORES)
async def test_async_auto_extend_runs_as_a_task_and_stops_on_release(alias: str, key: str) -> None:
    def make_lock(**kwargs: Any) -> Lock:
        return lock(key, store=alias, **kwargs)

    handle = make_lock(ttl=TTL, auto_extend=True)
    assert await handle.aacquire()
    assert not watchdog_threads(key) and len(watchdog_tasks(key)) == 1
    await asyncio.sleep(2.3 * TTL)
    handle.ensure_held()
    assert not await handle.ais_expired()
    assert not await make_lock().aacquire()
    assert await handle.arelease()
    await asyncio.sleep(0.05)
    assert not watchdog_tasks(key), "watchdog task outlived the release"
    assert await make_lock().aacquire()


async def test_async_watchdog_notices_takeover(
    make_lock: Callable[..., Lock], store: LockStore, key: str, lost_events: list[tuple[Lock, str]]
) -> None:
    handle = make_lock(ttl=TTL, auto_extend=True, on_lost="warn")  # the body goes on
    async with handle:
        assert await store.aget(key) is not None
        await asyncio.to_thread(store.force_release, key)
        thief = make_lock(ttl=30)
        assert await thief.aacquire()
        for _ in range(100):
            if handle.lost:
                break
            await asyncio.sleep(0.02)
        assert handle.lost and [lk for lk, _ in lost_events] == [handle]
        with pytest.raises(LockNotHeldError):
            handle.ensure_held()
    assert await thief.ais_locked() and not await thief.ais_expired()
    await thief.arelease()


@pytest.mark.parametrize("kind", [*store_params(["postgres"]), *store_params(["redis"])])
async def test_async_store_outage_marks_the_lock_lost(
    kind: str, key: str, lost_events: list[tuple[Lock, str]]
) -> None:
    context = outage(kind)  # set up and torn down off the loop: it talks to servers
    alias, cut = await asyncio.to_thread(context.__enter__)
    try:
        handle = lock(key, store=alias, ttl=TTL, auto_extend=True)
        assert await handle.aacquire()
        await asyncio.sleep(0.5 * TTL)
        await asyncio.to_thread(cut)
        cut_at = time.monotonic()
        for _ in range(150):
            if handle.lost:
                break
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - cut_at
        assert handle.lost and 0.3 * TTL < noticed < 1.0 * TTL + 0.5, noticed
        assert len(lost_events) == 1 and "ttl ran out" in lost_events[0][1]
        assert not watchdog_tasks(key)
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


# -- a late extend after the loss ---------------------------------------------------------


class _Watched:
    """One direction of one proxied connection, as the `LateReplyProxy` sees it: requests are
    looked at for the marker, replies held back while the proxy holds this connection's."""

    def __init__(self, sock: socket.socket, proxy: LateReplyProxy, upstream: socket.socket) -> None:
        self.sock, self.proxy, self.upstream = sock, proxy, upstream

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        if data:
            self.proxy.passing(self.upstream, data, reply=self.sock is self.upstream)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class LateReplyProxy(FaultyProxy):
    """A proxy that, after `hold_next_reply(marker)`, holds back every reply of the first
    connection that sends a request holding `marker` (that request runs; its answer comes
    late) until `let_go()`; other connections pass. The marker (the lock's key) picks the
    extend's connection, never a listener's ping that happens to be answered first."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.marker: bytes | None = None
        self.held: socket.socket | None = None
        self.gone = threading.Event()
        self.guard = threading.Lock()

    def hold_next_reply(self, marker: str) -> None:
        self.marker = marker.encode()

    def let_go(self) -> None:
        self.gone.set()

    def passing(self, upstream: socket.socket, data: bytes, *, reply: bool) -> None:
        with self.guard:
            if not reply and self.held is None and self.marker and self.marker in data:
                self.held = upstream
        if reply and self.held is upstream:
            self.gone.wait(30)

    def _pump(self, source: socket.socket, sink: socket.socket, reply: bool) -> None:
        upstream = source if reply else sink
        super()._pump(_Watched(source, self, upstream), sink, reply)  # type: ignore[arg-type]

    def close(self) -> None:
        self.let_go()
        super().close()


@contextmanager
def late_replies(kind: str) -> Iterator[tuple[str, LockStore, LateReplyProxy]]:
    """(alias, direct, proxy): a lock store reached through `proxy`, and a store on the same
    server reached directly, to see what the server holds whatever the proxy does."""
    if kind == "postgres":
        proxy = LateReplyProxy(int(connections["postgres"].settings_dict["PORT"]))
        with postgres_behind(proxy) as alias:
            yield alias, get_lock_store("postgres"), proxy
        return
    server = RedisServer().start()
    proxy = LateReplyProxy(server.port)
    proxied = RedisLockStore(alias="redis-late", options={"URL": proxy.url})
    direct = RedisLockStore(alias="redis-late-direct", options={"URL": server.url})
    set_lock_store(proxied, "redis-late")
    try:
        yield "redis-late", direct, proxy
    finally:
        proxy.close()
        set_lock_store(None, "redis-late")
        proxied.close()
        direct.close()
        server.stop()


LATE_TTL = 6.0  # renewals every 2 s: the give-back has ttl / 6 = 1 s, however loaded the machine


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", store_params(["postgres", "redis"]))
def test_a_lock_given_up_for_lost_while_an_extend_was_unanswered_is_freed_in_the_store(
    kind: str, use_async: bool, key: str, lost_events: list[tuple[Lock, str]]
) -> None:
    with late_replies(kind) as (alias, direct, proxy):
        handle = lock(key, store=alias, ttl=LATE_TTL, auto_extend=True, on_lost="warn")

        async def hold() -> None:
            assert await handle.aacquire()
            await asyncio.sleep(LATE_TTL / 2)  # one renewal confirmed (its expiry: 4/3 ttl)
            proxy.hold_next_reply(key)  # the next extend is made; its answer comes too late
            while not handle.lost:
                await asyncio.sleep(0.02)

        if use_async:
            asyncio.run(asyncio.wait_for(hold(), 3 * LATE_TTL))
        else:
            assert handle.acquire()
            time.sleep(LATE_TTL / 2)
            proxy.hold_next_reply(key)
            assert wait_until(lambda: handle.lost, 2 * LATE_TTL), "the loss was never found"
        assert wait_until(lambda: lost_events, 1.0)  # sent after `lost` is set
        assert [reason for _, reason in lost_events] == [
            "the store did not confirm an extend before the ttl ran out (no answer)"
        ]
        # The unanswered extend kept the lock a ttl from when it was sent (ttl / 3 more).
        assert wait_until(lambda: direct.get(key) is None, LATE_TTL / 6), (
            "the lock an unanswered extend kept was not given back"
        )
        assert handle.release() is False
