"""No Redis store call waits on a frozen server longer than the store's SOCKET_TIMEOUT: with a
URL and with a django-redis CONNECTION (whose pool may have no socket timeout at all), sync
and async. The handle keeps its owner, so the release is retried once the server is back.

Each test freezes a redis-server of its own with SIGSTOP: its kernel still accepts connections
and takes what is sent, and nothing ever answers.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_keel_lock import Lock, LockStoreUnavailable, lock
from django_keel_lock.stores import RedisLockStore

from .conftest import needs, serving
from .support.redis_servers import REDIS_SERVER, RedisServer

pytestmark = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")

SOCKET_TIMEOUT = 2
#: What a call may take behind a frozen server: SOCKET_TIMEOUT and some slack, far below the
#: forever a socket without a timeout waits.
BOUND = 4.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    thaw(server)
    server.stop()


def freeze(server: RedisServer) -> None:
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)


def thaw(server: RedisServer) -> None:
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)


@contextmanager
def redis_store(server: RedisServer, connection: str, **options: object) -> Iterator[str]:
    """A store on `server` with `options`, by URL or through a django-redis cache configured
    as django-redis documents it (no SOCKET_TIMEOUT: its pool's sockets never time out)."""
    alias = f"timeouts-{uuid.uuid4().hex[:8]}"
    caches = {
        **settings.CACHES,
        "frozen": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": server.url},
    }
    where = {"URL": server.url} if connection == "url" else {"CONNECTION": "frozen"}
    with override_settings(CACHES=caches):
        with serving(RedisLockStore(alias, {**where, **options})) as served:
            yield served


CONNECTIONS = pytest.mark.parametrize("connection", ["url", "cache"])


@contextmanager
def within(seconds: float) -> Iterator[None]:
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    assert elapsed < seconds, f"took {elapsed:.1f}s, more than {seconds}s"


@CONNECTIONS
def test_redis_calls_behind_a_frozen_server_give_up_after_socket_timeout(
    server: RedisServer, connection: str, key: str
) -> None:
    with redis_store(server, connection, SOCKET_TIMEOUT=SOCKET_TIMEOUT) as alias:
        held: Lock = lock(key, ttl=30, store=alias)
        assert held.acquire()
        owner = held.owner
        freeze(server)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            lock(f"{key}:other", store=alias).acquire(timeout=1)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            held.release()
        assert held.held and held.owner == owner
        thaw(server)
        assert held.release() is True


@CONNECTIONS
async def test_redis_async_calls_behind_a_frozen_server_give_up_after_socket_timeout(
    server: RedisServer, connection: str, key: str
) -> None:
    with redis_store(server, connection, SOCKET_TIMEOUT=SOCKET_TIMEOUT) as alias:
        held: Lock = lock(key, ttl=30, store=alias)
        assert await held.aacquire()
        owner = held.owner
        freeze(server)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            await lock(f"{key}:other", store=alias).aacquire(timeout=1)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            await held.arelease()
        assert held.held and held.owner == owner
        thaw(server)
        assert await held.arelease() is True


@CONNECTIONS
def test_redis_iter_locks_behind_a_frozen_server_gives_up_after_socket_timeout(
    server: RedisServer, connection: str, key: str
) -> None:
    with redis_store(server, connection, SOCKET_TIMEOUT=SOCKET_TIMEOUT) as alias:
        held: Lock = lock(key, ttl=30, store=alias)
        assert held.acquire()
        assert [info.key for info in held.store.iter_locks()] == [key]
        freeze(server)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            list(held.store.iter_locks())
        thaw(server)
        assert held.release()


def test_redis_url_socket_timeout_wins_over_the_option(server: RedisServer, key: str) -> None:
    """The URL is the store's own connection setting: its ?socket_timeout= is kept (here the
    shorter one, so the call gives up before the option's SOCKET_TIMEOUT would)."""
    alias = f"timeouts-{uuid.uuid4().hex[:8]}"
    store = RedisLockStore(alias, {"URL": server.url + "?socket_timeout=0.5", "SOCKET_TIMEOUT": 30})
    with serving(store):
        assert lock(key, store=alias).run(lambda: None).acquired
        freeze(server)
        with within(BOUND), pytest.raises(LockStoreUnavailable, match="Timeout"):
            lock(key, store=alias).acquire()


def test_redis_socket_timeout_defaults_to_five_seconds() -> None:
    assert RedisLockStore("t", {"URL": "redis://127.0.0.1:1/0"}).socket_timeout == 5.0
    assert RedisLockStore("t", {"URL": "x", "SOCKET_TIMEOUT": "1500ms"}).socket_timeout == 1.5


@pytest.mark.parametrize("value", [0, -1, "soon", None, True, float("inf")])
def test_redis_socket_timeout_must_be_a_positive_duration(value: object) -> None:
    with pytest.raises(
        ImproperlyConfigured, match=r"KEEL_LOCK_STORES\['bad'\] OPTIONS SOCKET_TIMEOUT"
    ):
        RedisLockStore("bad", {"URL": "redis://127.0.0.1:1/0", "SOCKET_TIMEOUT": value})
