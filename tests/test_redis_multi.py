"""RedisLockStore's multi-key operations (acquire_many, release_many, extend_many and their
async twins), called on the store itself: one script per acquire on one server, all or
nothing under contention, exclusive against single-key locks, the line of waiters, wake-ups
across processes, MIN_REPLICAS, an outage, and Redis Cluster's slot-by-slot way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from redis.crc import key_slot

from django_keel_lock import LockStoreUnavailable
from django_keel_lock.stores import RedisLockStore
from django_keel_lock.stores.base import semaphore_mode

from .conftest import needs, needs_store, skip_or_fail
from .support.multi_worker import counter_name, take_turns
from .support.redis_servers import (
    REDIS_SERVER,
    FaultyProxy,
    RedisServer,
    read_event,
    redis_cluster,
    redis_server,
    spawn,
)

pytestmark = needs_store("redis")

URL = settings.REDIS_URL
ROOT = Path(__file__).resolve().parent.parent
needs_server_binary = needs(os.path.exists(REDIS_SERVER), "the redis-server binary")


@pytest.fixture
def store() -> Iterator[RedisLockStore]:
    """A store of the test's own (own client, own listener), on the shared Redis."""
    own = RedisLockStore(f"multi-{uuid.uuid4().hex[:8]}", {"URL": URL})
    yield own
    own.close()


@pytest.fixture
def raw() -> Iterator[redis.Redis[bytes]]:
    client: redis.Redis[bytes] = redis.Redis.from_url(URL)
    yield client
    client.close()


def keys_of(key: str, count: int) -> tuple[str, ...]:
    return tuple(f"{key}:{i:02d}" for i in range(count))


def owner() -> str:
    return uuid.uuid4().hex


# -- one server -------------------------------------------------------------------------


def test_acquire_many_takes_every_key_with_fences_above_the_keys_last(
    store: RedisLockStore, key: str
) -> None:
    keys, first, second = keys_of(key, 3), owner(), owner()
    single = store.acquire(keys[1], first, "a", 30)
    assert single.fence is not None and store.release(keys[1], first)
    got = store.acquire_many(keys, second, "b", 30)
    assert got.fences is not None and len(got.fences) == 3
    assert got.fence == max(got.fences) and got.fences[1] > single.fence
    infos = [store.get(each) for each in keys]
    assert [(i.owner, i.holder, i.fence) for i in infos if i] == [
        (second, "b", fence) for fence in got.fences
    ]
    assert store.atomic_many
    assert store.release_many(keys, second)
    assert [store.get(each) for each in keys] == [None] * 3
    again = store.acquire_many(keys, first, "a", 30)
    assert again.fences is not None
    assert all(new > old for new, old in zip(again.fences, got.fences, strict=True))
    assert store.release_many(keys, first)


def test_acquire_many_takes_none_when_another_holds_one_and_names_the_held(
    store: RedisLockStore, key: str
) -> None:
    keys, holder, other = keys_of(key, 4), owner(), owner()
    assert store.acquire(keys[1], holder, "h", 30).acquired
    assert store.acquire(keys[3], holder, "h", 5).acquired
    refused = store.acquire_many(keys, other, "o", 30)
    assert not refused.acquired and refused.fences is None
    assert refused.blocked == (keys[1], keys[3])
    assert refused.held_as == "exclusive"
    assert refused.retry_in is not None and 0 < refused.retry_in <= 5
    assert store.get(keys[0]) is None and store.get(keys[2]) is None
    assert store.release_many((keys[1], keys[3]), holder)


def test_single_key_acquire_is_refused_while_a_multi_key_lock_holds_it(
    store: RedisLockStore, key: str
) -> None:
    keys, holder, other = keys_of(key, 2), owner(), owner()
    assert store.acquire_many(keys, holder, "h", 30).acquired
    assert not store.acquire(keys[1], other, "o", 30).acquired
    assert store.release_many(keys, holder)
    assert store.acquire(keys[1], other, "o", 30).acquired
    assert store.release(keys[1], other)


def test_acquire_many_again_by_the_owner_renews_with_the_same_fences(
    store: RedisLockStore, key: str, raw: redis.Redis[bytes]
) -> None:
    keys, holder = keys_of(key, 2), owner()
    first = store.acquire_many(keys, holder, "h", 1)
    assert store.acquire(keys[0], holder, "h", 1).fence == first.fences[0]  # type: ignore[index]
    again = store.acquire_many(keys, holder, "h", 60)
    assert again.fences == first.fences
    assert all(raw.pttl(store.lock_name(each)) > 30_000 for each in keys)
    assert store.release_many(keys, holder)


def test_acquire_many_refused_by_permits_says_how_the_key_is_held(
    store: RedisLockStore, key: str
) -> None:
    keys, reader, other = keys_of(key, 2), owner(), owner()
    assert store.acquire_permit(keys[0], reader, "r", 30, semaphore_mode(3)).acquired
    refused = store.acquire_many(keys, other, "o", 30)
    assert refused.blocked == (keys[0],) and refused.held_as == "semaphore"
    assert store.get(keys[1]) is None
    assert store.release_permit(keys[0], reader)


def test_expired_keys_are_taken_over_and_extend_many_then_leaves_the_new_holder_alone(
    store: RedisLockStore, key: str
) -> None:
    keys, first, second = keys_of(key, 2), owner(), owner()
    old = store.acquire_many(keys, first, "a", 0.1)
    time.sleep(0.2)
    new = store.acquire(keys[0], second, "b", 30)
    assert new.fence is not None and new.fence > old.fences[0]  # type: ignore[index]
    assert not store.extend_many(keys, first, 30)
    info = store.get(keys[0])
    assert info is not None and (info.owner, info.fence) == (second, new.fence)
    assert not store.release_many(keys, first)
    assert store.get(keys[0]) is not None
    taken = store.acquire_many(keys, first, "a", 30)
    assert taken.blocked == (keys[0],)
    assert store.release(keys[0], second)
    taken = store.acquire_many(keys, first, "a", 30)
    assert taken.fences is not None and taken.fences[1] > old.fences[1]  # type: ignore[index]
    assert store.extend_many(keys, first, 60)
    assert all(info and info.expires_in > 30 for info in map(store.get, keys))
    assert store.release_many(keys, first)


def test_release_many_frees_only_the_owner_s_keys(store: RedisLockStore, key: str) -> None:
    keys, first, second = keys_of(key, 2), owner(), owner()
    assert store.acquire(keys[0], first, "a", 30).acquired
    assert store.acquire(keys[1], second, "b", 30).acquired
    assert not store.release_many(keys, first)
    assert store.get(keys[0]) is None
    info = store.get(keys[1])
    assert info is not None and info.owner == second
    assert store.release(keys[1], second)


def test_a_free_key_with_a_waiter_in_line_is_taken_as_a_plain_acquire_takes_it(
    store: RedisLockStore, key: str
) -> None:
    """ACQUIRE (not queued) takes a free key whatever its line holds; so does
    ACQUIRE_MANY. A queued waiter keeps its place and is first again after. (The key is
    freed by its holder's ttl: a release would hand it over to the waiter.)"""
    single, multi = f"{key}:single", keys_of(key, 2)
    holder, waiter, plain = owner(), owner(), owner()
    for each in (single, multi[0]):
        assert store.acquire(each, holder, "h", 0.1).acquired
        assert not store.acquire_queued(each, waiter, "w", 30).acquired  # in line now
    time.sleep(0.2)
    assert store.acquire(single, plain, "p", 30).acquired
    assert store.acquire_many(multi, plain, "p", 30).acquired
    assert store.release(single, plain)
    assert store.release_many(multi, plain)
    for each in (single, multi[0]):
        assert store.acquire_queued(each, waiter, "w", 30).acquired
        assert store.release(each, waiter)


def test_release_many_wakes_the_first_in_line_or_the_release_channel_per_key(
    store: RedisLockStore, key: str, raw: redis.Redis[bytes]
) -> None:
    keys, holder, waiter = keys_of(key, 2), owner(), owner()
    with store.watch(f"{key}:other"):  # the listener runs: the waiter's place has its address
        deadline = time.monotonic() + 10
        while not store.push_wakeups and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.wake_address
        assert store.acquire_many(keys, holder, "h", 30).acquired
        assert not store.acquire_queued(keys[0], waiter, "w", 30).acquired
    pubsub = raw.pubsub()
    wake_channel = f"{store.wake_prefix}{store.wake_address}"
    pubsub.subscribe(wake_channel, *(store.release_channel(each) for each in keys))
    try:
        for _ in range(3):
            assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        assert store.release_many(keys, holder)
        heard = {}
        for _ in range(2):
            message = pubsub.get_message(timeout=5)
            assert message is not None
            heard[message["channel"].decode()] = message["data"].decode()
        assert heard == {wake_channel: keys[0], store.release_channel(keys[1]): "1"}
    finally:
        pubsub.close()
    store.leave_queue(keys[0], waiter)


def test_release_many_wakes_a_waiter_of_one_of_its_keys_in_another_process(
    store: RedisLockStore, key: str
) -> None:
    keys, holder = keys_of(key, 3), owner()
    assert store.acquire_many(keys, holder, "h", 30).acquired
    child = spawn("wait", "--url", URL, "--key", keys[2], "--timeout", "15", "--retry-delay", "10")
    try:
        assert read_event(child) == {"event": "waiting", "push": True}
        time.sleep(0.2)  # the child is in its acquire
        released_at = time.monotonic()
        assert store.release_many(keys, holder)
        returned = read_event(child)
        assert returned["acquired"]
        # It polls every 10 s: only the release's publish gets it there sooner.
        assert returned["at"] - released_at < 5
    finally:
        child.kill()
        child.wait()


def _count_turns(turns: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for keys, _ in turns:
        counts.update(keys)
    return counts


def test_contention_from_threads_and_processes_never_overlaps_a_key(
    store: RedisLockStore, key: str, raw: redis.Redis[bytes]
) -> None:
    """Two processes and two threads take random pairs of three keys, a third thread one key
    at a time: each key's counter (read, pause, write under the lock) loses no turn, and no
    two turns of a key share a fence."""
    keys = keys_of(key, 3)
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "tests.support.multi_worker", URL, "40", *keys]
    children = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    turns: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        threads = [
            threading.Thread(
                target=lambda size=size: turns.extend(take_turns(store, raw, keys, 40, size))
            )
            for size in (2, 2, 1)
        ]
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        for thread in threads:
            thread.start()
        for child in children:
            out, _ = child.communicate(timeout=120)
            turns.extend((tuple(k), tuple(f)) for k, f in json.loads(out))
        for thread in threads:
            thread.join(120)
    finally:
        for child in children:
            child.kill()
    assert len(turns) == 5 * 40
    counts = _count_turns(turns)
    for each in keys:
        assert int(raw.get(counter_name(each)) or 0) == counts[each], each
        fences = [f for ks, fs in turns for k, f in zip(ks, fs, strict=True) if k == each]
        assert len(set(fences)) == len(fences) == counts[each]
    raw.delete(*(counter_name(each) for each in keys))


async def test_async_twins_on_the_loops_client(store: RedisLockStore, key: str) -> None:
    keys, holder, other = keys_of(key, 2), owner(), owner()
    assert store._native_async()
    got = await store.aacquire_many(keys, holder, "h", 30)
    assert got.fences is not None
    refused = await store.aacquire_many(keys, other, "o", 30)
    assert refused.blocked == keys
    assert await store.aextend_many(keys, holder, 60)
    assert not await store.aextend_many(keys, other, 60)
    assert await store.arelease_many(keys, holder)
    assert not await store.arelease_many(keys, holder)
    assert [await store.aget(each) for each in keys] == [None, None]


def test_acquire_release_and_extend_many_of_ten_keys_are_one_round_trip_each(key: str) -> None:
    proxy = FaultyProxy(redis.connection.parse_url(URL).get("port", 6379))
    counted = RedisLockStore("multi-trips", {"URL": f"{proxy.url}"})
    try:
        keys, holder = keys_of(key, 10), owner()
        assert counted.get(keys[0]) is None  # connected, scripts loaded
        assert counted.acquire_many(keys, holder, "h", 30).acquired  # (NOSCRIPT once here)
        assert counted.release_many(keys, holder)
        for operation in (
            lambda: counted.acquire_many(keys, holder, "h", 30).acquired,
            lambda: counted.extend_many(keys, holder, 30),
            lambda: counted.release_many(keys, holder),
        ):
            before = proxy.trips
            assert operation()
            assert proxy.trips - before == 1
    finally:
        counted.close()
        proxy.close()


def test_keys_starting_with_one_hash_tag_share_a_slot_and_are_listed_back(
    store: RedisLockStore, key: str
) -> None:
    tag = "{" + key.replace("{", "(").replace("}", ")") + "}"
    keys = (f"{tag}:1", f"{tag}:2", f"{tag}:3}}x{{")
    assert len({key_slot(store.lock_name(each).encode()) for each in keys}) == 1
    assert store.lock_name(keys[0]) == f"{store.prefix}{{%7B{tag[1:-1]}}}:1}}"
    holder = owner()
    assert store.acquire_many(keys, holder, "h", 30).acquired
    assert [info.key for info in store.iter_locks(prefix=tag)] == list(keys)
    assert [info.key for info in store.iter_locks(prefix=tag[:-1])] == list(keys)
    assert store.release_many(keys, holder)


# -- a server of the test's own ---------------------------------------------------------


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as own:
        yield own


@needs_server_binary
async def test_an_outage_is_lock_store_unavailable_on_every_multi_key_operation(
    server: RedisServer,
) -> None:
    own = RedisLockStore("multi-outage", {"URL": server.url, "SOCKET_TIMEOUT": 1})
    try:
        keys, holder = ("a", "b"), owner()
        assert own.acquire_many(keys, holder, "h", 30).acquired
        assert (await own.aacquire_many(keys, holder, "h", 30)).acquired
        server.kill()
        for call in (
            lambda: own.acquire_many(keys, holder, "h", 30),
            lambda: own.extend_many(keys, holder, 30),
            lambda: own.release_many(keys, holder),
        ):
            with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
                call()
        with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
            await own.aacquire_many(keys, holder, "h", 30)
        with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
            await own.aextend_many(keys, holder, 30)
        with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
            await own.arelease_many(keys, holder)
    finally:
        own.close()


@needs_server_binary
async def test_min_replicas_short_gives_an_acquire_many_back_and_keeps_an_extended_one(
    server: RedisServer,
) -> None:
    """No replica: WAIT 1 gives up after half of SOCKET_TIMEOUT."""
    options = {"URL": server.url, "MIN_REPLICAS": 1, "SOCKET_TIMEOUT": 0.4}
    waiting = RedisLockStore("multi-replicas", options)
    plain = RedisLockStore("multi-plain", {"URL": server.url})
    try:
        keys, holder = ("a", "b"), owner()
        with pytest.raises(LockStoreUnavailable, match=r"MIN_REPLICAS.*it was given back"):
            waiting.acquire_many(keys, holder, "h", 30)
        assert [plain.get(each) for each in keys] == [None, None]
        with pytest.raises(LockStoreUnavailable, match=r"MIN_REPLICAS.*it was given back"):
            await waiting.aacquire_many(keys, holder, "h", 30)
        assert [plain.get(each) for each in keys] == [None, None]
        assert plain.acquire_many(keys, holder, "h", 30).acquired
        with pytest.raises(LockStoreUnavailable, match="keeps the expiry it had"):
            waiting.extend_many(keys, holder, 60)
        with pytest.raises(LockStoreUnavailable, match="keeps the expiry it had"):
            await waiting.aextend_many(keys, holder, 60)
        assert all(info and info.owner == holder for info in map(plain.get, keys))
        assert waiting.release_many(keys, holder)  # a release does not wait
    finally:
        waiting.close()
        plain.close()


# -- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    if not os.path.exists(REDIS_SERVER):
        skip_or_fail("needs the redis-server binary")
    with redis_cluster(3) as nodes:
        yield nodes


@pytest.fixture
def on_cluster(cluster: list[RedisServer]) -> Iterator[RedisLockStore]:
    own = RedisLockStore("multi-cluster", {"URL": cluster[0].url, "CLUSTER": True})
    yield own
    own.close()


def test_cluster_keys_with_one_hash_tag_are_one_script(
    on_cluster: RedisLockStore, key: str
) -> None:
    keys, holder, other = (f"{{{key}}}:1", f"{{{key}}}:2", f"{{{key}}}:3"), owner(), owner()
    assert not on_cluster.atomic_many  # in general: keys on several slots are not
    assert on_cluster.acquire(keys[2], other, "o", 30).acquired
    refused = on_cluster.acquire_many(keys, holder, "h", 30)
    assert refused.blocked == (keys[2],)
    assert on_cluster.get(keys[0]) is None
    assert on_cluster.release(keys[2], other)
    got = on_cluster.acquire_many(keys, holder, "h", 30)
    assert got.fences is not None and len(got.fences) == 3
    assert on_cluster.extend_many(keys, holder, 30)
    assert on_cluster.release_many(keys, holder)


def _spread(store: RedisLockStore, key: str) -> tuple[str, ...]:
    keys = keys_of(key, 6)
    slots = [key_slot(store.lock_name(each).encode()) for each in keys]
    assert len(set(slots)) == len(keys)  # each key on a slot of its own
    return keys


def test_cluster_keys_on_several_slots_are_taken_released_and_extended(
    on_cluster: RedisLockStore, key: str
) -> None:
    keys, holder, other = _spread(on_cluster, key), owner(), owner()
    got = on_cluster.acquire_many(keys, holder, "h", 30)
    assert got.fences is not None and len(got.fences) == len(keys)
    infos = [on_cluster.get(each) for each in keys]
    assert [info.fence for info in infos if info and info.owner == holder] == list(got.fences)
    assert not on_cluster.acquire(keys[3], other, "o", 30).acquired
    assert on_cluster.extend_many(keys, holder, 60)
    assert on_cluster.release_many(keys, holder)
    assert not on_cluster.release_many(keys, holder)
    assert not on_cluster.extend_many(keys, holder, 60)


def test_cluster_refusal_on_a_later_slot_gives_back_the_earlier_keys(
    on_cluster: RedisLockStore, key: str
) -> None:
    keys, holder, other = _spread(on_cluster, key), owner(), owner()
    assert on_cluster.acquire(keys[-1], other, "o", 30).acquired
    refused = on_cluster.acquire_many(keys, holder, "h", 30)
    assert not refused.acquired and refused.blocked == (keys[-1],)
    assert refused.retry_in is not None and refused.retry_in > 0
    assert [on_cluster.get(each) for each in keys[:-1]] == [None] * (len(keys) - 1)
    assert on_cluster.release(keys[-1], other)


def test_cluster_error_on_a_later_slot_gives_back_the_earlier_keys(
    on_cluster: RedisLockStore, cluster: list[RedisServer], key: str
) -> None:
    keys, holder = _spread(on_cluster, key), owner()
    client: redis.RedisCluster[bytes] = redis.RedisCluster.from_url(cluster[0].url)
    try:
        client.set(on_cluster.lock_name(keys[-1]), "not a lock")  # WRONGTYPE for the script
        with pytest.raises(LockStoreUnavailable, match="WRONGTYPE"):
            on_cluster.acquire_many(keys, holder, "h", 30)
        assert [on_cluster.get(each) for each in keys[:-1]] == [None] * (len(keys) - 1)
    finally:
        client.delete(on_cluster.lock_name(keys[-1]))
        client.close()


async def test_cluster_async_twins_take_slot_by_slot_and_give_back(
    on_cluster: RedisLockStore, key: str
) -> None:
    keys, holder, other = _spread(on_cluster, key), owner(), owner()
    assert on_cluster._native_async()
    assert await on_cluster.aacquire(keys[-1], other, "o", 30)
    refused = await on_cluster.aacquire_many(keys, holder, "h", 30)
    assert refused.blocked == (keys[-1],)
    assert [await on_cluster.aget(each) for each in keys[:-1]] == [None] * (len(keys) - 1)
    assert await on_cluster.arelease(keys[-1], other)
    got = await on_cluster.aacquire_many(keys, holder, "h", 30)
    assert got.fences is not None and len(got.fences) == len(keys)
    assert await on_cluster.aextend_many(keys, holder, 60)
    assert await on_cluster.arelease_many(keys, holder)
    assert [await on_cluster.aget(each) for each in keys] == [None] * len(keys)
