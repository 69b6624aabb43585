"""RedisLockStore against the real Redis at REDIS_URL: layout, atomic scripts, wake-ups,
several processes, a paused holder, and the native async methods."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from redis.crc import key_slot

from django_keel_lock import LockStoreUnavailable, get_lock_store, lock
from django_keel_lock.stores import AcquireResult, LockInfo, RedisLockStore
from django_keel_lock.stores.base import EXCLUSIVE, GATE_OWNER, SHARED, semaphore_mode
from django_keel_lock.stores.redis.clients import as_text
from django_keel_lock.stores.redis.scripts import ACQUIRE, SCRIPTS

from .conftest import needs, needs_store
from .support.redis_servers import (
    REDIS_SERVER,
    collector_off,
    own_connections,
    read_event,
    redis_server,
    settled_connections,
    spawn,
)

pytestmark = needs_store("redis")

URL = settings.REDIS_URL


@pytest.fixture
def raw() -> Iterator[redis.Redis[bytes]]:
    client = redis.Redis.from_url(URL)
    yield client
    client.close()


@pytest.fixture
def url_store() -> Iterator[RedisLockStore]:
    """A store of the test's own (own client, own listener), on the shared Redis."""
    store = RedisLockStore("own", {"URL": URL})
    yield store
    store.close()


@pytest.fixture(params=["redis", "redis-url"])
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "exactly one of CONNECTION"),
        ({"URL": URL, "CONNECTION": "default"}, "exactly one of CONNECTION"),
        ({"URL": URL, "KEY_PREFIX": "a{b}:"}, "without braces"),
        ({"CONNECTION": "default", "CLUSTER": True}, "CLUSTER needs URL"),
        ({"URL": URL, "TIMEOUT": 3}, "unknown option"),
    ],
)
def test_bad_options_are_refused_with_the_reason(options: dict[str, object], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        RedisLockStore("bad", options)


def test_connection_alias_reuses_the_django_redis_client() -> None:
    from django_redis import get_redis_connection

    store = get_lock_store("redis")
    assert isinstance(store, RedisLockStore)
    assert store._client() is get_redis_connection("locks")


# -- layout and scripts -----------------------------------------------------------------


def test_layout_is_one_hash_with_ttl_and_a_fence_counter_sharing_its_hash_tag(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    result = url_store.acquire(key, "o" * 32, "web-1:7", 20)
    assert result.fence is not None
    name = f"keel-lock:{{{key}}}"
    assert raw.hgetall(name)[b"o"] == b"o" * 32
    assert raw.hget(name, "h") == b"web-1:7"
    assert int(raw.hget(name, "f") or 0) == result.fence
    assert 19_000 < raw.pttl(name) <= 20_000
    assert int(raw.get(name + ":fence") or 0) == result.fence
    # The counter outlives the lock by a day, then goes: memory stays bounded for many keys.
    assert 86000 < raw.ttl(name + ":fence") <= 86400
    assert url_store.release(key, "o" * 32)
    assert not raw.exists(name) and int(raw.get(name + ":fence") or 0) == result.fence


def test_cluster_keyslot_is_shared_even_for_keys_with_braces(url_store: RedisLockStore) -> None:
    for key in ["}x{", "{}", "a}b", "{tag}rest", "%7D"]:
        lock_name, fence_name = url_store._names(key)
        assert lock_name.count("{") == 1 and lock_name.endswith("}")
        assert fence_name == lock_name + ":fence"


def test_retry_with_the_same_owner_after_a_lost_reply_returns_the_same_acquisition(
    url_store: RedisLockStore, key: str
) -> None:
    first = url_store.acquire(key, "a" * 32, "h", 5)
    again = url_store.acquire(key, "a" * 32, "h", 5)
    assert first.fence is not None and again.fence == first.fence
    other = url_store.acquire(key, "b" * 32, "h", 5)
    assert other.fence is None and other.retry_in is not None and 4.0 < other.retry_in <= 5.0
    assert url_store.release(key, "a" * 32)
    assert not url_store.release(key, "a" * 32)


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_scripts_are_called_by_sha_after_a_script_flush(key: str) -> None:
    # On a server of its own: SCRIPT FLUSH is server-wide, so on the shared Redis another run
    # (or its flush) could unload the scripts between the acquire and the check.
    with redis_server() as server:
        store = RedisLockStore("own-flush", {"URL": server.url})
        raw: redis.Redis[bytes] = redis.Redis.from_url(server.url)
        try:
            raw.script_flush()
            assert raw.script_exists(ACQUIRE.sha) == [False]  # type: ignore[no-untyped-call]
            assert store.acquire(key, "a" * 32, "h", 5).acquired  # loads every script once
            shas = (script.sha for script in SCRIPTS)
            loaded = raw.script_exists(*shas)  # type: ignore[no-untyped-call]
            assert loaded == [True] * len(SCRIPTS)
            assert store.release(key, "a" * 32)
        finally:
            store.close()
            raw.close()


def test_ttl_is_kept_in_milliseconds(url_store: RedisLockStore, key: str) -> None:
    assert url_store.acquire(key, "a" * 32, "h", 0.25).acquired
    info = url_store.get(key)
    assert info is not None and 0.15 < info.expires_in <= 0.25
    time.sleep(0.3)
    assert url_store.get(key) is None
    assert url_store.acquire(key, "b" * 32, "h", 1).acquired


def test_keys_with_braces_percent_and_glob_characters_list_exactly(
    url_store: RedisLockStore, key: str
) -> None:
    names = [f"{key}:{suffix}" for suffix in ["{a}", "}", "%7B", "*", "?", "[x]", "\\", "%"]]
    for name in names:
        assert url_store.acquire(name, "o" * 32, "h", 10).acquired, name
    assert url_store.acquire(f"{key}*other", "o" * 32, "h", 10).acquired
    listed = [info.key for info in url_store.iter_locks(prefix=f"{key}:")]
    assert listed == sorted(names)
    assert [info.key for info in url_store.iter_locks(prefix=f"{key}:{{")] == [f"{key}:{{a}}"]
    for name in [*names, f"{key}*other"]:
        assert url_store.release(name, "o" * 32)


def test_a_key_of_another_type_under_the_prefix_is_left_out_of_the_listing_and_named(
    alias: str, raw: redis.Redis[bytes], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Something else wrote a string where a lock's hash would be (as a test of the refusal
    below does on this shared server): `locks list` and the admin still show the locks."""
    store = get_lock_store(alias)
    stray = f"{store.prefix}{{{key}:stray}}"
    raw.set(stray, "not a hash", px=5000)
    assert store.acquire(f"{key}:held", "o" * 32, "h", 10).acquired
    try:
        with caplog.at_level("WARNING", logger="django_keel_lock"):
            listed = [info.key for info in store.iter_locks(prefix=key)]
        assert listed == [f"{key}:held"]
        assert f"{key}:stray" in caplog.text and "WRONGTYPE" in caplog.text
    finally:
        store.release(f"{key}:held", "o" * 32)
        raw.delete(stray)


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_a_listing_the_server_refuses_is_a_store_error_not_an_empty_list(key: str) -> None:
    """A user the server does not let read the locks (an ACL without HMGET): `locks list`
    says the store failed, never "nothing is held" while locks are held."""
    with redis_server() as server:
        server.cli("acl", "setuser", "lister", "on", ">pw", "~*", "&*", "+@all", "-hmget")
        admin = RedisLockStore("admin", {"URL": server.url})
        lister = RedisLockStore("lister", {"URL": f"redis://lister:pw@127.0.0.1:{server.port}/0"})
        try:
            assert admin.acquire(key, "o" * 32, "h", 30).acquired
            assert [info.key for info in admin.iter_locks()] == [key]
            with pytest.raises(LockStoreUnavailable, match=r"NOPERM|no permissions"):
                list(lister.iter_locks())
        finally:
            admin.close()
            lister.close()


def test_prefixes_keep_stores_apart(raw: redis.Redis[bytes], key: str) -> None:
    one = RedisLockStore("one", {"URL": URL, "KEY_PREFIX": "keel-one:"})
    two = RedisLockStore("two", {"URL": URL, "KEY_PREFIX": "keel-two:"})
    try:
        assert one.acquire(key, "a" * 32, "h", 5).acquired
        assert two.acquire(key, "b" * 32, "h", 5).acquired
        assert raw.exists(f"keel-one:{{{key}}}") and raw.exists(f"keel-two:{{{key}}}")
        assert [i.owner for i in two.iter_locks(prefix=key)] == ["b" * 32]
    finally:
        one.release(key, "a" * 32)
        two.release(key, "b" * 32)
        one.close()
        two.close()


@pytest.mark.parametrize("given", ["keel-sep-{run}", "keel-sep-{run}:"])
def test_key_prefix_is_joined_with_a_colon_unless_it_ends_with_one(
    raw: redis.Redis[bytes], key: str, given: str
) -> None:
    run = uuid.uuid4().hex[:12]
    store = RedisLockStore("sep", {"URL": URL, "KEY_PREFIX": given.format(run=run)})
    try:
        assert store.acquire(key, "a" * 32, "h", 5).acquired
        names = sorted(as_text(name) for name in raw.scan_iter(match=f"keel-sep-{run}*"))
        assert names == [f"keel-sep-{run}:{{{key}}}", f"keel-sep-{run}:{{{key}}}:fence"]
        assert store.release_channel(key) == f"keel-sep-{run}:released:{key}"
        assert [info.key for info in store.iter_locks(prefix=key)] == [key]
    finally:
        store.release(key, "a" * 32)
        raw.delete(f"keel-sep-{run}:{{{key}}}:fence")
        store.close()


def test_key_prefix_with_and_without_its_colon_names_the_same_locks(key: str) -> None:
    run = uuid.uuid4().hex[:12]
    bare = RedisLockStore("bare", {"URL": URL, "KEY_PREFIX": f"keel-same-{run}"})
    joined = RedisLockStore("joined", {"URL": URL, "KEY_PREFIX": f"keel-same-{run}:"})
    try:
        assert bare.acquire(key, "a" * 32, "h", 5).acquired
        assert not joined.acquire(key, "b" * 32, "h", 5).acquired
        assert joined.release(key, "a" * 32)
    finally:
        redis.Redis.from_url(URL).delete(f"keel-same-{run}:{{{key}}}:fence")
        bare.close()
        joined.close()


def test_force_release_frees_and_reports_the_holder(url_store: RedisLockStore, key: str) -> None:
    assert url_store.acquire(key, "a" * 32, "someone", 10).acquired
    freed = url_store.force_release(key)
    assert freed is not None and freed.owner == "a" * 32 and freed.holder == "someone"
    assert url_store.get(key) is None and url_store.prune() == 0


def test_permit_keys_share_the_tag_expire_with_the_latest_permit_and_go_with_the_last(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    gate, permits, holders, fence, writer = url_store._permit_names(key)
    names = (gate, permits, holders, fence, writer)
    assert len({key_slot(name.encode()) for name in names}) == 1  # one script, one Cluster slot
    short, long = "a" * 32, "b" * 32
    assert url_store.acquire_permit(key, short, "short", 10, SHARED).acquired
    assert url_store.acquire_permit(key, long, "long", 20, SHARED).acquired
    assert raw.hget(gate, "o") == GATE_OWNER["shared"].encode()
    for name in (gate, permits, holders):
        assert 19_000 < raw.pttl(name) <= 20_000
    channel = url_store.release_channel(key)
    with raw.pubsub() as pubsub:
        pubsub.subscribe(channel)
        assert pubsub.get_message(timeout=5) is not None  # the subscription itself
        assert url_store.release_permit(key, long)  # not the last: announced all the same
        message = pubsub.get_message(timeout=5)
        assert message is not None and message["channel"] == channel.encode()
    for name in (gate, permits, holders):
        assert 9_000 < raw.pttl(name) <= 10_000
    assert not url_store.acquire_permit(key, "w" * 32, "w", 5, EXCLUSIVE, 3).acquired
    assert 2_000 < raw.pttl(writer) <= 3_000 and raw.get(writer) == b"w" * 32
    assert url_store.release_permit(key, short)
    assert raw.exists(gate, permits, holders) == 0 and raw.exists(fence) == 1


def test_permit_keys_left_by_an_expired_gate_are_ignored_and_cleared(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    """Redis expires the gate and its helper keys one by one: permits seen without a live gate
    must not count, nor come back under the next gate."""
    _, permits, holders, _, _ = url_store._permit_names(key)
    stale = "s" * 32
    raw.zadd(permits, {stale: int(time.time() * 1000) + 60_000})
    raw.hset(holders, stale, "1:1:stale")
    one = semaphore_mode(1)
    assert not url_store.holders(key)
    taken = url_store.acquire(key, "x" * 32, "x", 5)
    assert taken.acquired and [i.owner for i in url_store.holders(key)] == ["x" * 32]
    assert url_store.release(key, "x" * 32)
    assert url_store.acquire_permit(key, "p" * 32, "p", 5, one).acquired
    assert [(i.owner, i.mode) for i in url_store.holders(key)] == [("p" * 32, "semaphore")]
    assert raw.zrange(permits, 0, -1) == [b"p" * 32] and raw.hkeys(holders) == [b"p" * 32]
    assert url_store.release_permit(key, "p" * 32)


def test_wrong_type_at_the_lock_key_is_a_store_error_not_contention(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    raw.set(f"keel-lock:{{{key}}}", "not a hash", px=5000)
    with pytest.raises(LockStoreUnavailable, match="WRONGTYPE"):
        url_store.acquire(key, "a" * 32, "h", 5)


# -- wake-ups ---------------------------------------------------------------------------


def test_release_in_another_store_instance_wakes_a_waiter_through_pubsub(
    alias: str, key: str
) -> None:
    """Two store objects, as in two processes: only pub/sub can carry the release across."""
    other = RedisLockStore("other", {"URL": URL, "KEY_PREFIX": get_lock_store(alias).prefix})  # type: ignore[attr-defined]
    try:
        holder = lock(key, ttl=30, store=alias)
        assert holder.acquire()
        waiter = get_lock_store(alias)
        with waiter.watch(key):
            deadline = time.monotonic() + 5
            while not waiter.push_wakeups and time.monotonic() < deadline:
                time.sleep(0.01)
            assert waiter.push_wakeups
        woke: list[float] = []

        def wait() -> None:
            handle = lock(key, ttl=30, store=alias)
            assert handle.acquire(timeout=20, retry_delay=10)
            woke.append(time.monotonic())
            handle.release()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.3)  # the waiter is asleep on push by now (its next poll: ~30 s away)
        released_at = time.monotonic()
        assert other.release(key, holder.owner or "")
        thread.join(10)
        assert woke, "the waiter did not wake up on a release made by another store instance"
        assert woke[0] - released_at < 0.5
    finally:
        other.close()


def test_push_wakeups_is_false_in_a_forked_child(url_store: RedisLockStore, key: str) -> None:
    with url_store.watch(key):
        deadline = time.monotonic() + 5
        while not url_store.push_wakeups and time.monotonic() < deadline:
            time.sleep(0.01)
        assert url_store.push_wakeups
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the parent's listener thread does not exist here
            os.write(write, b"1" if url_store.push_wakeups else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"0"
        os.close(read)
        os.close(write)


def test_waiter_in_another_process_wakes_on_release_well_before_its_poll(key: str) -> None:
    holder = lock(key, ttl=30, store="redis")
    assert holder.acquire()
    child = spawn("wait", "--url", URL, "--key", key, "--timeout", "15", "--retry-delay", "10")
    try:
        ready = read_event(child)
        assert ready["event"] == "waiting" and ready["push"] is True
        time.sleep(0.5)  # let the child block in acquire
        released_at = time.monotonic()
        assert holder.release()
        done = read_event(child)
        latency = done["at"] - released_at
        assert done["acquired"] is True
        assert latency < 0.5, f"waiter took {latency:.3f}s after the release"
        assert done["fence"] > (holder.fence or 0)
    finally:
        child.kill()
        child.communicate(timeout=10)


# -- several processes ------------------------------------------------------------------


def test_eight_processes_exclude_each_other_and_count_exactly(key: str, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    iterations = 15
    children = [
        spawn(
            "count",
            "--url",
            URL,
            "--key",
            key,
            "--iterations",
            str(iterations),
            "--counter",
            str(counter),
        )
        for _ in range(8)
    ]
    try:
        results = [read_event(child, timeout=60) for child in children]
        assert all(r["event"] == "ready" for r in results)
        done = [read_event(child, timeout=90) for child in children]
    finally:
        for child in children:
            child.kill()
            child.communicate(timeout=10)
    assert int(counter.read_text()) == 8 * iterations
    intervals = sorted(tuple(i) for r in done for i in r["intervals"])
    assert len(intervals) == 8 * iterations
    for (_, end, fence), (start, _, next_fence) in itertools.pairwise(intervals):
        assert start >= end, "two processes were inside the critical section at once"
        assert next_fence > fence, "fences must increase in the order the lock was held"


def test_paused_holder_is_taken_over_and_its_release_false_extend_raises_fence_lower(
    key: str,
) -> None:
    child = spawn("stale", "--alias", "redis-url", "--key", key, "--ttl", "0.5", "--work", "1.2")
    try:
        acquired = read_event(child)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            time.sleep(0.8)  # past its ttl while it cannot run
            fresh = lock(key, ttl=30, store="redis-url")
            assert fresh.acquire(timeout=5)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        after = read_event(child)
        assert after["extend"].startswith("raised:") and "taken over" in after["extend"]
        assert after["release"] is False
        assert acquired["fence"] < (fresh.fence or 0)
        info = fresh.info()
        assert info is not None and info.owner == fresh.owner
        assert fresh.release()
    finally:
        child.kill()
        child.communicate(timeout=10)


# -- native async -----------------------------------------------------------------------


async def test_async_methods_are_atomic_and_native(alias: str, key: str) -> None:
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    assert store._native_async()
    before = threading.active_count()
    got = await store.aacquire(key, "a" * 32, "h", 5)
    assert got.fence is not None
    assert threading.active_count() == before  # no worker thread was used
    miss = await store.aacquire(key, "b" * 32, "h", 5)
    assert miss.fence is None and miss.retry_in is not None and miss.retry_in <= 5
    assert await store.aextend(key, "a" * 32, 30)
    assert await store.aextend(key, "a" * 32, 1)  # never shortens
    info = await store.aget(key)
    assert info is not None and info.owner == "a" * 32 and info.expires_in > 25
    assert info.fence == got.fence
    assert not await store.aextend(key, "b" * 32, 30)
    assert not await store.arelease(key, "b" * 32)

    woken = asyncio.Event()
    loop = asyncio.get_running_loop()
    token = store.wake_board.add_callback(key, lambda: loop.call_soon_threadsafe(woken.set))
    try:
        assert await store.arelease(key, "a" * 32)
        await asyncio.wait_for(woken.wait(), 2)
    finally:
        store.wake_board.remove_callback(token)
    assert await store.aget(key) is None
    again = await store.aacquire(key, "b" * 32, "h", 5)
    assert again.fence is not None and again.fence > got.fence
    assert await store.arelease(key, "b" * 32)


async def test_async_store_unreachable_raises_store_unavailable(key: str) -> None:
    from .support.redis_servers import free_port

    store = RedisLockStore("gone", {"URL": f"redis://127.0.0.1:{free_port()}/0"})
    with pytest.raises(LockStoreUnavailable, match="cannot use Redis"):
        await store.aacquire(key, "a" * 32, "h", 5)
    with pytest.raises(LockStoreUnavailable):
        await store.arelease(key, "a" * 32)


def test_unique_owner_tokens_do_not_collide(key: str) -> None:
    store = get_lock_store("redis")
    owners = [uuid.uuid4().hex for _ in range(20)]
    results = [store.acquire(key, owner, "h", 5) for owner in owners]
    assert [r.acquired for r in results] == [True] + [False] * 19
    assert store.release(key, owners[0])


@pytest.mark.parametrize("alias", ["redis", "redis-url"])
def test_many_concurrent_async_acquires_queue_for_connections_instead_of_failing(
    alias: str, key: str
) -> None:
    # More tasks than a connection pool holds: none may be told the store is unavailable.
    handles = [lock(f"{key}:{i}", store=alias, ttl=30) for i in range(300)]

    async def everyone() -> list[object]:
        results = await asyncio.gather(*(h.aacquire() for h in handles), return_exceptions=True)
        await asyncio.gather(*(h.arelease() for h in handles if h.held))
        return results

    results = asyncio.run(everyone())
    assert results == [True] * len(handles)


def test_fences_keep_growing_when_the_counter_has_expired(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    fences = []
    for _ in range(3):
        got = url_store.acquire(key, "o" * 32, "h", 5)
        assert got.fence is not None
        fences.append(got.fence)
        assert url_store.release(key, "o" * 32)
        raw.delete(f"keel-lock:{{{key}}}:fence")  # as if its day had passed
    assert fences == sorted(fences) and len(set(fences)) == 3, fences


def test_a_process_subscribes_only_to_the_keys_it_waits_for(
    url_store: RedisLockStore, raw: redis.Redis[bytes], key: str
) -> None:
    waited, other = f"{key}:waited", f"{key}:other"

    def subscribers(name: str) -> int:
        channel = url_store.release_channel(name)
        return int(dict(raw.pubsub_numsub(channel))[channel.encode()])

    def settles(name: str, count: int) -> bool:
        deadline = time.monotonic() + 5
        while subscribers(name) != count and time.monotonic() < deadline:
            time.sleep(0.01)
        return subscribers(name) == count

    with url_store.watch(waited):
        assert settles(waited, 1)  # this process hears `waited`'s releases...
        assert subscribers(other) == 0  # ...and nothing of keys nobody here waits for
    assert settles(waited, 0)  # the last waiter left: unsubscribed

    # Waiting again within the listener's `linger`: still subscribed, so no new subscription
    # and no wake-up for a release that might have slipped by.
    with url_store.watch(waited):
        assert settles(waited, 1)
    time.sleep(0.3)  # the listener has heard that nobody waits
    assert subscribers(waited) == 1
    with url_store.watch(waited) as again:
        time.sleep(0.3)
        assert subscribers(waited) == 1
        assert not again.poll()
    assert settles(waited, 0)


def _own(raw: redis.Redis[bytes], at_most: int | None = None) -> int:
    """This process's connections to Redis (see REDIS_CLIENT_NAME), settled."""
    return settled_connections(raw, settings.REDIS_CLIENT_NAME, at_most)


def test_event_loops_that_finish_close_their_redis_connections(
    alias: str, raw: redis.Redis[bytes], key: str
) -> None:
    async def use(index: int) -> None:
        async with lock(f"{key}:{index}", store=alias, ttl=30):
            pass

    asyncio.run(use(-1))  # first use of the alias may connect its own sync client: not counted
    before = _own(raw)
    with collector_off():
        for index in range(15):
            asyncio.run(use(index))  # a new event loop each time, as asyncio.run / async_to_sync
        assert _own(raw, at_most=before) <= before, "finished event loops left connections open"


def test_one_long_lived_event_loop_keeps_one_client_and_its_connection(
    alias: str, raw: redis.Redis[bytes], key: str
) -> None:
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    asyncio.run(store.aget(key))  # the sync client and its connections: not counted
    before = _own(raw)

    async def serve() -> int:
        clients = set()
        for index in range(50):  # one request after another, as on one ASGI server's loop
            async with lock(f"{key}:{index}", store=alias, ttl=30):
                clients.add(id(store._loop_client()))
        assert len(clients) == 1, "a client was made for a call instead of once for the loop"
        return own_connections(raw, settings.REDIS_CLIENT_NAME)

    with collector_off():
        assert asyncio.run(serve()) <= before + 1  # the loop's pool: one connection, reused
        assert _own(raw, at_most=before) <= before  # and closed with the loop


def test_a_loop_that_would_not_close_the_client_gets_one_closed_after_each_call(
    alias: str, raw: redis.Redis[bytes], key: str
) -> None:
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    asyncio.run(store.aget(key))
    before = _own(raw)

    async def without_the_loop_s_hooks() -> None:
        # As on a loop that does not track async generators: shutdown_asyncgens() would not
        # know of the one that closes the clients.
        sys.set_asyncgen_hooks(firstiter=None, finalizer=None)  # run_forever restores them
        for index in range(5):
            async with lock(f"{key}:{index}", store=alias, ttl=30):
                pass
            assert store._loop_client() is None
            assert _own(raw, at_most=before) <= before

    with collector_off():
        asyncio.run(without_the_loop_s_hooks())


def test_a_release_while_the_loop_shuts_down_reaches_redis(alias: str, key: str) -> None:
    """An abandoned async generator holding a lock releases it when asyncio.run closes the
    loop's async generators, together with the one that closes the loop's clients."""
    abandoned = []

    async def rows() -> AsyncIterator[int]:
        async with lock(key, store=alias, ttl=30):
            yield 1
            yield 2

    async def main() -> None:
        for _ in range(8):  # whichever async generator the loop closes first
            stream = rows()
            await anext(stream)
            abandoned.append(stream)
            await stream.aclose()
        stream = rows()
        await anext(stream)  # left holding the lock as the loop ends
        abandoned.append(stream)

    asyncio.run(main())
    assert get_lock_store(alias).get(key) is None, "the lock was left for its ttl"


def test_a_store_the_project_replaced_does_not_live_on_with_the_event_loop(
    raw: redis.Redis[bytes], key: str
) -> None:
    name = settings.REDIS_CLIENT_NAME
    url = f"{URL}?client_name={name}"

    async def serve() -> list[bool]:
        """Whether each replaced store is still alive, asked while the loop runs."""
        replaced = []
        for index in range(3):  # as override_settings or a settings change rebuild stores
            store = RedisLockStore(f"replaced-{index}", {"URL": url, "KEY_PREFIX": f"{key}:"})
            await store.aget(key)
            store.close()
            replaced.append(weakref.ref(store))
            del store
        gc.collect()
        return [ref() is not None for ref in replaced]

    before = _own(raw)
    with collector_off():
        assert asyncio.run(serve()) == [False, False, False]
        assert _own(raw, at_most=before) <= before


def test_a_call_in_flight_survives_the_store_being_closed_on_its_loop(
    url_store: RedisLockStore, key: str
) -> None:
    async def main() -> tuple[AcquireResult, object]:
        await url_store.aget(key)  # the loop's client
        in_flight = asyncio.ensure_future(url_store.aacquire(key, "owner-1", "h", 30))
        await asyncio.sleep(0)  # sent; its reply not read yet
        url_store.close()  # the next call makes a new client; this one must finish first
        other = await url_store.aget(key)
        return await in_flight, other

    acquired, seen = asyncio.run(main())
    assert acquired.acquired
    assert isinstance(seen, LockInfo) and seen.owner == "owner-1"
    assert url_store.release(key, "owner-1")


@pytest.mark.parametrize("alias", ["redis", "redis-url"])
def test_async_views_served_a_loop_per_request_leave_no_connection_open(
    alias: str, key: str
) -> None:
    """Under WSGI (runserver, gunicorn sync workers) Django runs each async view in an event loop
    of its own. Under `python -X dev` an unclosed socket is a ResourceWarning, and as an error it
    is reported on stderr ("Exception ignored in ...")."""
    child = spawn(
        "requests",
        "--alias",
        alias,
        "--key",
        key,
        "--iterations",
        "20",
        flags=("-X", "dev", "-W", "error::ResourceWarning"),
    )
    try:
        done = read_event(child, timeout=60)
    finally:
        _, stderr = child.communicate(timeout=30)
    assert child.returncode == 0, stderr
    assert "unclosed" not in stderr and "ResourceWarning" not in stderr, stderr
    assert done["after"] <= done["before"], done
