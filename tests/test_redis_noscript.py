"""A Redis server that lost its scripts (new, restarted, SCRIPT FLUSH) answers NOSCRIPT: on each
way the store runs a script (a thread's own connection, the redis-py client, the async client,
the worker threads for async code) every script is loaded again and the call goes through.

Each test has a server of its own: SCRIPT FLUSH is server-wide, so on the shared Redis another
run (or its flush) could unload the scripts between the call and the check."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import redis
from django.test import override_settings

from django_keel_lock.stores import RedisLockStore
from django_keel_lock.stores.base import semaphore_mode
from django_keel_lock.stores.redis.scripts import ACQUIRE, SCRIPTS

from .conftest import needs, needs_store
from .support.redis_servers import REDIS_SERVER, RedisServer, redis_server

pytestmark = [
    needs_store("redis"),
    needs(os.path.exists(REDIS_SERVER), "the redis-server binary"),
]


class OtherPool(redis.ConnectionPool):
    """A pool class of the project's own: the store cannot tell what its connections need, so
    it runs the scripts through the redis-py client, and its async methods on worker threads."""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as own:
        yield own


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis[bytes]]:
    client: redis.Redis[bytes] = redis.Redis.from_url(server.url)
    client.script_flush()
    assert client.script_exists(ACQUIRE.sha) == [False]  # type: ignore[no-untyped-call]
    yield client
    client.close()


@pytest.fixture
def url_store(server: RedisServer) -> Iterator[RedisLockStore]:
    store = RedisLockStore("noscript-url", {"URL": server.url})
    yield store
    store.close()


@pytest.fixture
def client_store(server: RedisServer) -> Iterator[RedisLockStore]:
    """A store through a django-redis cache whose pool is OtherPool."""
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": server.url,
        "OPTIONS": {"CONNECTION_POOL_CLASS": f"{__name__}.OtherPool"},
    }
    with override_settings(CACHES={"default": cache, "noscript": cache}):
        store = RedisLockStore("noscript-client", {"CONNECTION": "noscript"})
        yield store
        store.close()


def all_loaded(raw: redis.Redis[bytes]) -> bool:
    loaded = raw.script_exists(*(script.sha for script in SCRIPTS))  # type: ignore[no-untyped-call]
    return bool(loaded == [True] * len(SCRIPTS))


def test_sync_scripts_on_a_threads_own_connection_are_reloaded(
    raw: redis.Redis[bytes], url_store: RedisLockStore, key: str
) -> None:
    assert url_store._script_connection() is not None
    assert url_store.acquire(key, "a" * 32, "h", 5).acquired
    assert all_loaded(raw)
    assert url_store.release(key, "a" * 32)


def test_sync_scripts_through_the_redis_py_client_are_reloaded(
    raw: redis.Redis[bytes], client_store: RedisLockStore, key: str
) -> None:
    assert client_store._script_connection() is None
    assert client_store.acquire(key, "a" * 32, "h", 5).acquired
    assert all_loaded(raw)
    assert client_store.release(key, "a" * 32)


async def test_async_scripts_on_the_loops_client_are_reloaded(
    raw: redis.Redis[bytes], url_store: RedisLockStore, key: str
) -> None:
    assert url_store._native_async()
    got = await url_store.aacquire_permit(key, "a" * 32, "h", 5, semaphore_mode(2))
    assert got.acquired
    assert all_loaded(raw)
    assert await url_store.arelease_permit(key, "a" * 32)


async def test_async_scripts_on_worker_threads_are_reloaded(
    raw: redis.Redis[bytes], client_store: RedisLockStore, key: str
) -> None:
    assert not client_store._native_async()
    before = set(threading.enumerate())
    assert (await client_store.aacquire(key, "a" * 32, "h", 5)).acquired
    assert any(t.name.startswith("keel-lock-") for t in set(threading.enumerate()) - before)
    assert all_loaded(raw)
    info = await client_store.aget(key)
    assert info is not None and info.owner == "a" * 32
    assert await client_store.arelease(key, "a" * 32)
    assert await client_store.aget(key) is None


@pytest.mark.parametrize("which", ["url_store", "client_store"])
async def test_multi_key_scripts_are_reloaded_sync_and_async(
    raw: redis.Redis[bytes], which: str, request: pytest.FixtureRequest, key: str
) -> None:
    store: RedisLockStore = request.getfixturevalue(which)
    keys, owner = (f"{key}:1", f"{key}:2"), "a" * 32
    assert store.acquire_many(keys, owner, "h", 5).acquired
    assert all_loaded(raw)
    raw.script_flush()
    assert store.extend_many(keys, owner, 5)
    raw.script_flush()
    assert store.release_many(keys, owner)
    raw.script_flush()
    assert (await store.aacquire_many(keys, owner, "h", 5)).acquired
    raw.script_flush()
    assert await store.aextend_many(keys, owner, 5)
    raw.script_flush()
    assert await store.arelease_many(keys, owner)
    assert all_loaded(raw)
