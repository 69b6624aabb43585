"""Direct hand-off (Redis, PostgreSQL, MariaDB): a release that finds a live waiter first in the
key's line grants the lock to it in the same script, statement or transaction (owner, holder, a
greater fence) and wakes it. When the wake-up reaches the waiter's process (Redis: its listener
is subscribed; PostgreSQL: the connection its listener LISTENs on is there; MariaDB: that
connection still holds the named lock of its wake address), the grant is for the waiter's own
ttl and the message carries it (MariaDB: the woken listener reads it): the waiter becomes the
holder with no call. Otherwise the grant
is short and the waiter's next `acquire_queued` takes it up at its own ttl. A granted waiter
that died or gave up costs the others at most its grant ttl, and one that leaves the line
passes the grant on. The tests of how Redis keeps a line across versions of its scripts, of
its `:grant` channel and of its round trips run on Redis only. (The durability of a PostgreSQL
release that hands over is tests/test_database_release_flush.py's.)"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connections
from django.utils import timezone

from django_keel_lock import lock
from django_keel_lock.models import Waiter
from django_keel_lock.registry import get_lock_store
from django_keel_lock.stores.base import QUEUE_LEASE, LockStore
from django_keel_lock.stores.database import DatabaseLockStore
from django_keel_lock.stores.redis import RedisLockStore

from .conftest import database_of, serving, store_params
from .support.holders import held_before_children
from .support.round_trips import RoundTrips, round_trips
from .test_database_faults import wait_until

ALIASES = store_params(["redis", "postgres", "mariadb"])
#: The tests of what only Redis has (its scripts' versions, place formats, `:grant` channel,
#: round trips): `alias` (and the fixtures built on it) is the Redis store's alone.
REDIS_ONLY = pytest.mark.parametrize("alias", store_params(["redis"]))
#: The stores whose waiting thread reads the listener's connection itself (`reads_here`); a
#: MariaDB listener reads its process's grants and hands them on.
READS_HERE = pytest.mark.parametrize("alias", store_params(["redis", "postgres"]))
#: Polls are 5 s apart: whatever a waiter gets within a lease came by a push or a grant.
RETRY_DELAY = 5.0
CONTEXT = multiprocessing.get_context("fork")
#: The stores that hand off, as `unheard` and `heard` are.
ServerStore = RedisLockStore | DatabaseLockStore


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def unheard(alias: str) -> Iterator[ServerStore]:
    """A store of `alias`'s settings with no listener: its waiters' places have no wake
    address (in a database, no listener connection), so a release grants them the short
    grant a call takes up, never a carried one. As a store of its own, it is another
    process's too: its release wakes none of this process's waiters itself."""
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore | DatabaseLockStore)
    quiet = type(store)(f"{alias}-unheard", store.options)
    try:
        yield quiet
    finally:
        quiet.close()


@pytest.fixture
def heard(alias: str, key: str) -> Iterator[ServerStore]:
    """A store of `alias`'s settings whose listener is connected and listens for `key` (as
    while a waiter of this process watches it): a release reaches its waiters' process, and
    so carries their grants."""
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore | DatabaseLockStore)
    listening = type(store)(f"{alias}-heard", store.options)
    try:
        with listening.watch(key):
            listener = listening._listener
            assert wait_until(
                lambda: listening.listener_ready() and key in getattr(listener, "subscribed", ()),
                10,
            ), "the listener never listened"
            yield listening
    finally:
        listening.close()


def _waiter(alias: str, key: str, name: str, pipe: Connection, ttl: float = 30) -> None:
    """Wait for `key` as holder `name` (telling the parent just before); hold it a moment,
    release; send back (acquired, its fence)."""
    handle = lock(key, ttl=ttl, holder=name, store=alias)
    handle.is_locked()  # connected before it asks
    pipe.send("asking")
    got = handle.acquire(timeout=30, retry_delay=RETRY_DELAY)
    fence = handle.fence if got else None
    if got:
        time.sleep(0.02)
        handle.release()
    pipe.send((got, fence))


def _in_line(alias: str, key: str, count: int, close: bool = True) -> None:
    """Wait until `count` waiters a release reaches stand in `key`'s line (read from the
    server itself); `close`: then close the store, so children started next do not share
    its connections."""
    store = get_lock_store(alias)
    deadline = time.monotonic() + 20
    while _standing(store, alias, key) < count:
        assert time.monotonic() < deadline, f"never {count} in line"
        time.sleep(0.02)
    if close:
        store.close()


def _standing(store: LockStore, alias: str, key: str) -> int:
    """How many live places in `key`'s line say where their process listens (Redis: a wake
    address; a database: its listener's connection too): that process's listener was
    connected when its waiter last asked. A waiter's first attempt may come before it is,
    and a release would then hand it the short grant, not one carried in the wake-up."""
    if isinstance(store, RedisLockStore):
        name = store.lock_name(key)
        line = store.client().lrange(name + ":line", 0, -1)
        places = store.client().hmget(name + ":places", line) if line else []
        return sum(1 for place in places if place and not place.endswith(b":"))
    places = Waiter.objects.using(database_of(alias)).filter(key=key)
    live = places.filter(expires_at__gt=timezone.now()).exclude(address="")
    try:
        return live.filter(listener__isnull=False).count()
    finally:
        if threading.current_thread() is not threading.main_thread():
            connections.close_all()  # this thread's: none is left open at the end


def _line_of(store: LockStore, alias: str, key: str) -> list[str]:
    """The owners still waiting in `key`'s line, in order (a database keeps the place of
    the waiter handed the lock, marked with its fence, until it takes the lock up)."""
    if isinstance(store, RedisLockStore):
        line = store.client().lrange(store.lock_name(key) + ":line", 0, -1)
        return [each.decode() for each in line]
    places = Waiter.objects.using(database_of(alias)).filter(key=key, fence__isnull=True)
    live = places.filter(expires_at__gt=timezone.now()).order_by("id")
    return list(live.values_list("owner", flat=True))


def _start(
    alias: str, key: str, name: str, ahead: int = 0, ttl: float = 30
) -> tuple[Any, Connection]:
    """A waiter process for `key`, once it stands in line behind `ahead` others."""
    parent, child = CONTEXT.Pipe()
    proc = CONTEXT.Process(target=_waiter, args=(alias, key, name, child, ttl), daemon=True)
    proc.start()
    assert parent.poll(30) and parent.recv() == "asking"
    _in_line(alias, key, ahead + 1)
    return proc, parent


def _listener_gone(alias: str, key: str, holder: str) -> None:
    """In a database, wait until the server saw the connection that the process of
    `holder`'s place in `key`'s line listened on end (a killed process's, at once as a rule;
    MariaDB frees its named locks with it):
    a release then hands that place the lock for what is left of it, not its whole ttl."""
    if isinstance(get_lock_store(alias), RedisLockStore):
        return
    database = database_of(alias)
    place = Waiter.objects.using(database).get(key=key, holder=holder)

    sql = (
        "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = %s"
        if connections[database].vendor == "mysql"
        else "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
    )

    def gone() -> bool:
        with connections[database].cursor() as cursor:
            cursor.execute(sql, [place.listener])
            row = cursor.fetchone()
            return bool(row[0] == 0)

    assert place.listener is not None and wait_until(gone, 10)


def _stand(store: LockStore, key: str, owner: str, ttl: float = 30) -> None:
    """`owner` asks for the held `key` as a waiter and so stands in its line (through
    `unheard`, with no listener: a release hands it a grant to take up, as to a waiter whose
    listener is away; one carried in the wake-up, at its whole ttl, is `heard`'s)."""
    assert not store.acquire_queued(key, owner, f"holder-{owner[:4]}", ttl).acquired


def _handed_over(store: LockStore, key: str) -> tuple[str, str]:
    """`key` held by "a"*32, then released with two waiters in line: (the first, to whom it
    was handed over, and the second)."""
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    first, second = "b" * 32, "c" * 32
    _stand(store, key, first)
    _stand(store, key, second)
    assert store.release(key, "a" * 32)
    return first, second


def test_a_release_grants_the_lock_to_the_first_in_line_in_the_same_script(
    unheard: ServerStore, key: str
) -> None:
    store = unheard
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    first, second = "b" * 32, "c" * 32
    _stand(store, key, first)
    _stand(store, key, second)
    assert store.release(key, "a" * 32)
    info = store.get(key)
    assert info is not None and info.owner == first and info.holder == "holder-bbbb"
    # Granted for QUEUE_LEASE at most until the waiter takes it up: a dead one costs no more.
    assert 0 < info.expires_in <= QUEUE_LEASE
    # Nobody outside the line takes it meanwhile, waiting or not.
    assert not store.acquire(key, "d" * 32, "barger", 30).acquired
    assert not store.acquire_queued(key, second, "holder-cccc", 30).acquired
    taken = store.acquire_queued(key, first, "holder-bbbb", 30)
    assert taken.fence == info.fence  # its grant, now at its own ttl
    renewed = store.get(key)
    assert renewed is not None and renewed.expires_in > QUEUE_LEASE
    assert store.release(key, first)
    after = store.get(key)
    assert after is not None and after.owner == second and after.fence > info.fence
    assert store.release(key, second)
    assert store.get(key) is None


def test_a_waiter_leaving_the_line_once_granted_passes_the_grant_on(
    unheard: ServerStore, key: str
) -> None:
    store = unheard
    first, second = _handed_over(store, key)  # to `first`, which gives up as it comes
    granted = store.get(key)
    assert granted is not None and granted.owner == first
    store.leave_queue(key, first)
    passed = store.get(key)
    assert passed is not None and passed.owner == second and passed.fence > granted.fence
    store.leave_queue(key, second)
    assert store.get(key) is None


@pytest.mark.parametrize("listening", ["heard", "unheard"])
def test_a_waiter_handed_the_lock_that_releases_it_with_several_keys_holds_nobody_up(
    alias: str, listening: str, request: pytest.FixtureRequest, key: str
) -> None:
    # It never asked again (the grant came carried in its wake-up, or it had not taken its
    # short grant up), and a multi-key release (or an idempotent result's) only wakes: its
    # place must not stay first in line.
    store = request.getfixturevalue(listening)  # built on `alias`
    first = "b" * 32
    # Heard: `first` waits in this process, and takes the grant its wake-up carries (a grant
    # nobody here waits for is given back at once, on a thread: the lock would go on to the
    # second in line whenever that thread came before this one's next call).
    waits = store.watch(key, first) if listening == "heard" else contextlib.nullcontext()
    with waits:
        assert _handed_over(store, key)[0] == first
        if listening == "heard":
            board = store.wake_board
            assert wait_until(lambda: board.granted(key, first) is not None, 10), "no grant"
            assert board.take_grant(key, first) is not None
        granted = store.get(key)
        assert granted is not None and granted.owner == first
        assert (granted.expires_in > QUEUE_LEASE) == (listening == "heard")  # carried or short
        assert store.release_many((key,), first)
    assert store.acquire_queued(key, "c" * 32, "holder-cccc", 30).acquired
    assert store.release(key, "c" * 32)


def test_a_waiter_that_asks_after_its_grant_lapsed_keeps_its_turn(
    unheard: ServerStore, key: str
) -> None:
    # It missed the wake-up (its listener was reconnecting, say) and its ttl is short: its
    # grant lapses before it asks again, but its place is still first.
    store = unheard
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    slow, other = "b" * 32, "c" * 32
    _stand(store, key, slow, ttl=0.2)
    _stand(store, key, other)
    assert store.release(key, "a" * 32)
    granted = store.get(key)
    assert granted is not None and granted.owner == slow and granted.expires_in <= 0.2
    time.sleep(0.3)
    assert store.get(key) is None  # lapsed
    assert not store.acquire_queued(key, other, "holder-cccc", 30).acquired
    taken = store.acquire_queued(key, slow, "holder-bbbb", 0.2)
    assert taken.fence is not None and taken.fence > granted.fence
    assert store.release(key, slow)
    after = store.get(key)
    assert after is not None and after.owner == other
    assert store.release(key, other)


def test_waiting_processes_are_handed_the_lock_in_the_order_they_joined(
    alias: str, key: str
) -> None:
    holder = held_before_children(alias, key)
    names = [f"waiter-{i}" for i in range(5)]
    waiters = [_start(alias, key, name, ahead=i) for i, name in enumerate(names)]
    store = get_lock_store(alias)
    assert holder.release()
    info = store.get(key)
    assert info is not None and info.holder == names[0]  # handed over by the release itself
    assert info.expires_in > QUEUE_LEASE  # for its ttl: the wake-up carried the grant
    results = [pipe.recv() if pipe.poll(20) else None for _, pipe in waiters]
    for proc, _ in waiters:
        proc.join(10)
    assert all(result is not None and result[0] for result in results), results
    fences = [result[1] for result in results if result is not None]
    assert fences[0] == info.fence
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert fences[0] > holder.fence


def test_a_granted_waiter_killed_before_it_wakes_costs_the_next_at_most_its_grant_ttl(
    alias: str, key: str
) -> None:
    holder = held_before_children(alias, key)
    doomed, _ = _start(alias, key, "doomed")
    stayer = _start(alias, key, "stayer", ahead=1)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(5)
    _listener_gone(alias, key, "doomed")
    released = time.monotonic()
    assert holder.release()  # its place is still live: the grant goes to the dead one
    store = get_lock_store(alias)
    grant = store.get(key)
    assert grant is not None and grant.holder == "doomed"
    assert grant.expires_in <= QUEUE_LEASE
    assert stayer[1].poll(10)
    got, fence = stayer[1].recv()
    waited = time.monotonic() - released
    assert got and fence > grant.fence
    # The grant lapses by itself; the next asks again when it does (its refusal said when).
    assert waited < QUEUE_LEASE * 1.5, waited


def test_an_async_waiter_cancelled_while_granted_passes_the_grant_on(
    alias: str, unheard: ServerStore, key: str
) -> None:
    # The holder is `unheard`, as in another process: its release wakes none of this
    # process's waiters itself.
    other = unheard
    assert other.acquire(key, "a" * 32, "holder", 30).acquired

    async def scenario() -> None:
        handle = lock(key, ttl=30, holder="cancelled", store=alias)
        task = asyncio.ensure_future(handle.aacquire(timeout=30, retry_delay=RETRY_DELAY))
        await asyncio.to_thread(_in_line, alias, key, 1, False)  # it stands first in line
        _stand(other, key, "c" * 32)
        # Released and cancelled with no await between: the task has not woken.
        assert other.release(key, "a" * 32)
        granted = other.get(key)
        assert granted is not None and granted.holder == "cancelled"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        passed = other.get(key)
        assert passed is not None and passed.owner == "c" * 32
        assert passed.fence > granted.fence

    asyncio.run(scenario())
    other.leave_queue(key, "c" * 32)
    assert other.get(key) is None


def test_the_store_hands_off(alias: str) -> None:
    assert get_lock_store(alias).hands_off


def test_a_release_nobody_waits_for_frees_the_lock(alias: str, key: str) -> None:
    store = get_lock_store(alias)
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    assert store.release(key, "a" * 32)
    assert store.get(key) is None
    assert not store.release(key, "a" * 32)


def test_a_waiter_that_took_its_grant_up_and_leaves_keeps_the_lock(
    unheard: ServerStore, key: str
) -> None:
    # A multi-key waiter takes a key of its line with acquire_many (a fence of its own),
    # then leaves the line: the lock stays its own.
    store = unheard
    first, second = _handed_over(store, key)
    taken = store.acquire_many((key, f"{key}:other"), first, "holder-bbbb", 30)
    assert taken.acquired
    store.leave_queue(key, first)
    kept = store.get(key)
    assert kept is not None and kept.owner == first
    assert store.release_many((key, f"{key}:other"), first)
    store.leave_queue(key, second)


def test_a_waiter_timing_out_as_it_is_granted_passes_the_lock_on(
    alias: str, unheard: ServerStore, key: str
) -> None:
    # A thread of this process waits with a timeout that ends about when the release (by
    # `unheard`, as another process's) hands it the lock; whichever comes first, the next
    # in line gets the lock at once: taken up and released, or passed on.
    other = unheard
    assert other.acquire(key, "a" * 32, "holder", 30).acquired
    handle = lock(key, ttl=30, holder="leaving", store=alias)
    got: list[bool] = []
    thread = threading.Thread(
        target=lambda: got.append(handle.acquire(timeout=1.0, retry_delay=RETRY_DELAY))
    )
    thread.start()
    _in_line(alias, key, 1, close=False)
    _stand(other, key, "c" * 32)
    time.sleep(max(0.0, 0.95 - 0.1))
    assert other.release(key, "a" * 32)
    thread.join(10)
    if got == [True]:
        assert handle.release()
    passed = other.get(key)
    assert passed is not None and passed.owner == "c" * 32
    assert other.release(key, "c" * 32)


def test_a_multi_key_waiter_handed_a_key_keeps_it_once_it_takes_them_all(
    alias: str, unheard: ServerStore, key: str
) -> None:
    # It stands in the line of `b` (held), is handed `b` by its release and takes `a` and
    # `b` at once: leaving `b`'s line then must not give `b` away to the next in line.
    store, other = get_lock_store(alias), unheard
    a, b = f"{key}:a", f"{key}:b"
    try:
        assert other.acquire(b, "a" * 32, "holder", 30).acquired
        handle = lock([a, b], ttl=30, holder="many", store=alias)
        got: list[bool] = []
        thread = threading.Thread(
            target=lambda: got.append(handle.acquire(timeout=20, retry_delay=RETRY_DELAY))
        )
        thread.start()
        _in_line(alias, b, 1, close=False)
        _stand(other, b, "c" * 32)
        assert other.release(b, "a" * 32)
        thread.join(20)
        assert got == [True]
        held_a, held_b = store.get(a), store.get(b)
        assert held_a is not None and held_b is not None
        assert held_b.owner == held_a.owner and held_b.holder == "many"
        assert not other.acquire_queued(b, "c" * 32, "holder-cccc", 30).acquired
        assert handle.release()  # a multi-key release wakes the next in line
        assert other.acquire_queued(b, "c" * 32, "holder-cccc", 30).acquired
        assert other.release(b, "c" * 32)
    finally:
        other.leave_queue(b, "c" * 32)


def _place_by_hand(store: RedisLockStore, key: str, owner: str, fields: dict[str, str]) -> None:
    """Put `owner` last in `key`'s line with the place `fields`, as a given version of the
    scripts writes one; the line lapses in 2 s."""
    client, name = store.client(), store.lock_name(key)
    client.hset(name + ":places", mapping=fields)
    client.rpush(name + ":line", owner)
    client.pexpire(name + ":places", 2000)
    client.pexpire(name + ":line", 2000)


@REDIS_ONLY
def test_a_place_written_before_hand_offs_gets_a_wake_up_and_no_grant(alias: str, key: str) -> None:
    # During a rolling upgrade a waiter of the previous version keeps its place as
    # "expiry:address", with no ttl and holder beside it: a release cannot know them, so it
    # only wakes it, and the waiter takes the free lock itself as before.
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    until = int(store.client().time()[0]) * 1000 + int(QUEUE_LEASE * 1000)
    _place_by_hand(store, key, "b" * 32, {"b" * 32: f"{until}:"})
    assert store.release(key, "a" * 32)
    assert store.get(key) is None
    # "later" waits in this process, as a waiter does: a grant carried to it stays its own
    # (one carried to a process where nobody waits for the key is given back).
    with store.watch(key, "c" * 32):
        assert not store.acquire_queued(key, "c" * 32, "later", 30).acquired  # not its turn
        assert store.acquire_queued(key, "b" * 32, "old", 30).acquired
        assert store.release(key, "b" * 32)  # "later" stood with a new place: handed over
        info = store.get(key)
        assert info is not None and info.owner == "c" * 32
        store.leave_queue(key, "c" * 32)
    assert store.get(key) is None


@REDIS_ONLY
def test_a_grant_lives_no_longer_than_the_place_of_its_waiter(alias: str, key: str) -> None:
    # The first in line last asked 1.7 s ago (it was killed then): its place lapses in 0.3 s,
    # and so must the lock handed to it, or a dead waiter holds the others up for up to twice
    # QUEUE_LEASE from its death instead of QUEUE_LEASE.
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    seconds, micros = store.client().time()
    until = int(seconds) * 1000 + int(micros) // 1000 + 300
    place = {"b" * 32: f"{until}:", "b" * 32 + ":": "30000:dead"}  # ttl 30 s, holder "dead"
    _place_by_hand(store, key, "b" * 32, place)
    assert store.release(key, "a" * 32)
    granted = store.get(key)
    assert granted is not None and granted.holder == "dead"
    assert granted.expires_in <= 0.3


@pytest.fixture
def at_abcd(alias: str, monkeypatch: pytest.MonkeyPatch) -> RedisLockStore:
    """`alias`'s store, whose waiters say their process listens at the wake address "abcd"
    (a test subscribes to its channels by hand)."""
    store = get_lock_store(alias)
    assert isinstance(store, RedisLockStore)
    monkeypatch.setattr(RedisLockStore, "wake_address", property(lambda self: "abcd"))
    return store


@contextmanager
def _subscribed(store: RedisLockStore, channel: str) -> Iterator[Any]:
    """A pub/sub connection subscribed to `channel` (Redis has confirmed it)."""
    subscriber = store.client().pubsub()
    try:
        subscriber.subscribe(channel)
        assert subscriber.get_message(timeout=5)["type"] == "subscribe"
        yield subscriber
    finally:
        subscriber.close()


#: RELEASE as the version before hand-offs has it: during a rolling upgrade its processes
#: still release, and must still wake a waiter of this version first in line.
PREVIOUS_RELEASE = """
local first = nil
local address = nil
while true do
    first = redis.call('LINDEX', KEYS[2], 0)
    if not first then
        break
    end
    local place = redis.call('HGET', KEYS[3], first)
    if place then
        local until_ms, rest = string.match(place, '^(%d+):(.*)$')
        local now = redis.call('TIME')
        if tonumber(until_ms) > now[1] * 1000 + math.floor(now[2] / 1000) then
            address = rest
            break
        end
    end
    redis.call('LPOP', KEYS[2])
    redis.call('HDEL', KEYS[3], first)
end
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
    redis.call('DEL', KEYS[1])
    if not first then
        redis.call('PUBLISH', ARGV[2], '1')
    elseif address ~= '' then
        redis.call('PUBLISH', ARGV[3] .. address, ARGV[4])
    end
    return 1
end
return 0
"""


@REDIS_ONLY
def test_a_release_of_the_previous_version_still_wakes_a_waiter_of_this_one(
    at_abcd: RedisLockStore, key: str
) -> None:
    store = at_abcd
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    _stand(store, key, "b" * 32)  # a waiter of this version, its process at "abcd"
    client, name = store.client(), store.lock_name(key)
    with _subscribed(store, store.wake_prefix + "abcd") as subscriber:
        names = (name, name + ":line", name + ":places")
        args = ("a" * 32, store.release_channel(key), store.wake_prefix, key)
        assert client.eval(PREVIOUS_RELEASE, 3, *names, *args) == 1
        woken = subscriber.get_message(timeout=5)
        assert woken is not None and woken["data"] == key.encode()
    assert store.acquire_queued(key, "b" * 32, "holder-bbbb", 30).acquired
    assert store.release(key, "b" * 32)


# -- grants carried by the wake-up --------------------------------------------------------
def test_a_release_heard_by_the_waiters_process_grants_its_whole_ttl_and_carries_the_grant(
    alias: str, heard: ServerStore, unheard: ServerStore, key: str
) -> None:
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    with heard.watch(key, "b" * 32) as waiter:
        refused = heard.acquire_queued(key, "b" * 32, "holder-bbbb", 30)
        assert not refused.acquired and refused.last_fence is not None
        _stand(unheard, key, "c" * 32)
        assert unheard.release(key, "a" * 32)
        info = unheard.get(key)
        assert info is not None and info.owner == "b" * 32 and info.holder == "holder-bbbb"
        assert info.fence > refused.last_fence
        assert info.expires_in > QUEUE_LEASE  # its own ttl: it makes no call to keep it
        assert _line_of(unheard, alias, key) == ["c" * 32]  # out of the line: the holder now
        deadline = time.monotonic() + 10
        while (fence := heard.wake_board.take_grant(key, "b" * 32)) is None:
            assert time.monotonic() < deadline, "the grant never came"
            waiter.wait(1)
        assert fence == info.fence
    assert unheard.release(key, "b" * 32)
    after = unheard.get(key)
    assert after is not None and after.owner == "c" * 32 and after.fence > info.fence
    unheard.leave_queue(key, "c" * 32)


@READS_HERE
def test_a_waiting_thread_reads_its_grant_itself_while_the_listener_goes_on_subscribing(
    heard: ServerStore, unheard: ServerStore, key: str
) -> None:
    # A thread waiting for a key reads the listener's connection itself (`read_here`): the
    # wake-up carrying its grant wakes it, not the listener's thread, which would have to wake
    # it in turn. The listener still subscribes to the keys other threads begin to wait for
    # meanwhile (PostgreSQL: the reading thread stops for that, as libpq allows one thread at
    # a time on a connection), and both threads get their grants.
    listener = heard._listener
    assert listener is not None
    other = key + ":other"
    fences: dict[str, int] = {}

    def wait(which: str, owner: str) -> None:
        with heard.watch(which, owner) as waiter:
            assert not heard.acquire_queued(which, owner, "waiter", 30).acquired
            deadline = time.monotonic() + 10
            while (fence := heard.wake_board.take_grant(which, owner)) is None:
                if time.monotonic() > deadline:
                    return
                waiter.wait(1)
            fences[which] = fence

    for each in (key, other):
        assert unheard.acquire(each, "a" * 32, "holder", 30).acquired
    first = threading.Thread(target=wait, args=(key, "b" * 32))
    first.start()
    assert wait_until(listener._reading.locked, 10), "the waiting thread never read"
    second = threading.Thread(target=wait, args=(other, "c" * 32))
    second.start()
    assert wait_until(lambda: other in listener.subscribed, 10), "never subscribed meanwhile"
    time.sleep(0.2)  # both wait
    for each in (other, key):
        assert unheard.release(each, "a" * 32)
    first.join(15)
    second.join(15)
    assert set(fences) == {key, other}, fences
    for each, owner in ((key, "b" * 32), (other, "c" * 32)):
        info = unheard.get(each)
        assert info is not None and info.owner == owner and info.fence == fences[each]
        assert unheard.release(each, owner)


def test_a_carried_grant_its_waiter_never_took_is_passed_on_when_it_leaves(
    heard: ServerStore, unheard: ServerStore, key: str
) -> None:
    # It gave up (timed out, was cancelled) as the grant came: the engine leaves the line.
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    with heard.watch(key, "b" * 32):
        _stand(heard, key, "b" * 32)
        _stand(unheard, key, "c" * 32)
        assert unheard.release(key, "a" * 32)
        granted = unheard.get(key)
        assert granted is not None and granted.owner == "b" * 32
        assert granted.expires_in > QUEUE_LEASE
        heard.leave_queue(key, "b" * 32)
    passed = unheard.get(key)
    assert passed is not None and passed.owner == "c" * 32 and passed.fence > granted.fence
    unheard.leave_queue(key, "c" * 32)
    assert unheard.get(key) is None


@pytest.fixture
def counted(alias: str) -> Iterator[tuple[str, RoundTrips]]:
    """(alias, proxy): a store of `alias`'s settings whose connections (its listener's too)
    go through a proxy that counts their round trips, under an alias of its own."""
    url = urlsplit(settings.REDIS_URL)
    with round_trips(url.hostname or "127.0.0.1", url.port or 6379) as proxy:
        proxied = f"redis://127.0.0.1:{proxy.port}{url.path}"
        with serving(RedisLockStore(f"{alias}-counted", {"URL": proxied})) as name:
            yield name, proxy


@REDIS_ONLY
def test_a_waiter_handed_a_carried_grant_makes_no_call_to_become_the_holder(
    counted: tuple[str, RoundTrips], unheard: ServerStore, key: str
) -> None:
    proxied, proxy = counted
    assert isinstance(unheard, RedisLockStore)
    store = get_lock_store(proxied)
    assert isinstance(store, RedisLockStore)
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    with store.watch(key):  # its release channel subscribed before the waiter comes
        channel = store.release_channel(key)
        deadline = time.monotonic() + 10
        while not unheard.client().pubsub_numsub(channel)[0][1]:
            assert time.monotonic() < deadline, "never subscribed"
            time.sleep(0.01)
        handle = lock(key, ttl=30, holder="waiter", store=proxied)
        trips: list[int] = []

        def wait() -> None:
            if handle.acquire(timeout=20, retry_delay=RETRY_DELAY):
                trips.append(proxy.count)

        thread = threading.Thread(target=wait)
        thread.start()
        _in_line(proxied, key, 1, close=False)  # its refused attempt has been sent
        before = proxy.count
        assert unheard.release(key, "a" * 32)
        thread.join(20)
    assert trips == [before]  # acquired, and not one round trip since it was refused
    info = unheard.get(key)
    assert info is not None and info.holder == "waiter" and info.fence == handle.fence
    assert handle.release()


@REDIS_ONLY
def test_a_stale_grant_message_is_ignored(
    heard: ServerStore, unheard: ServerStore, key: str
) -> None:
    # A grant message that arrives after a later refusal (pub/sub and commands are not
    # ordered with each other) names a fence the refusal had already seen: not a grant.
    assert isinstance(heard, RedisLockStore) and isinstance(unheard, RedisLockStore)
    with serving(heard) as alias:
        assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
        handle = lock(key, ttl=30, holder="waiter", store=alias)
        got: list[bool] = []
        thread = threading.Thread(
            target=lambda: got.append(handle.acquire(timeout=20, retry_delay=RETRY_DELAY))
        )
        thread.start()
        _in_line(alias, key, 1, close=False)
        owner = _line_of(unheard, alias, key)[0]
        places = unheard.lock_name(key) + ":places"
        place = unheard.client().hget(places, owner)
        held = unheard.get(key)
        assert held is not None
        message = f"{held.fence} {owner} {key}"  # the holder's own fence: drawn before
        assert unheard.client().publish(
            unheard.wake_prefix + heard.wake_address + ":grant", message
        )
        deadline = time.monotonic() + 10
        while unheard.client().hget(places, owner) == place:  # it asked again: refused
            assert time.monotonic() < deadline, "the waiter never asked again"
            time.sleep(0.01)
        assert got == [] and thread.is_alive()
        assert unheard.release(key, "a" * 32)
        thread.join(20)
        assert got == [True] and handle.fence is not None and handle.fence > held.fence
        info = unheard.get(key)
        assert info is not None and info.owner == handle.owner
        assert handle.release()


@REDIS_ONLY
def test_a_waiter_whose_process_is_not_subscribed_for_grants_gets_the_short_grant_and_a_wake_up(
    at_abcd: RedisLockStore, key: str
) -> None:
    # A waiter process of the previous version listens on its wake channel only: the
    # carried grant reaches nobody, so the release grants the short grant a call takes up
    # and wakes it the way it knows.
    store = at_abcd
    assert store.acquire(key, "a" * 32, "holder", 30).acquired
    _stand(store, key, "b" * 32)
    with _subscribed(store, store.wake_prefix + "abcd") as subscriber:
        assert store.release(key, "a" * 32)
        woken = subscriber.get_message(timeout=5)
        assert woken is not None and woken["data"] == key.encode()
    granted = store.get(key)
    assert granted is not None and granted.owner == "b" * 32
    assert granted.expires_in <= QUEUE_LEASE
    assert store.acquire_queued(key, "b" * 32, "holder-bbbb", 30).fence == granted.fence
    assert store.release(key, "b" * 32)


@REDIS_ONLY
def test_a_carried_grant_names_fence_owner_and_key(at_abcd: RedisLockStore, key: str) -> None:
    store = at_abcd
    spaced = key + " with spaces:and colons"
    assert store.acquire(spaced, "a" * 32, "holder", 30).acquired
    _stand(store, spaced, "b" * 32)
    with _subscribed(store, store.wake_prefix + "abcd:grant") as subscriber:
        assert store.release(spaced, "a" * 32)
        carried = subscriber.get_message(timeout=5)
    granted = store.get(spaced)
    assert granted is not None and granted.owner == "b" * 32
    assert carried is not None
    assert carried["data"] == f"{granted.fence} {'b' * 32} {spaced}".encode()
    assert granted.expires_in > QUEUE_LEASE
    assert store.release(spaced, "b" * 32)


def test_a_waiter_stopped_and_killed_after_a_carried_grant_costs_the_next_at_most_its_ttl(
    alias: str, key: str
) -> None:
    # Its process is frozen, so the server still counts its listener (Redis: subscribed;
    # PostgreSQL: its connection there): the release carries it a grant for its ttl (short
    # here), which it never takes; killed, it costs the next in line that grant, and no more.
    holder = held_before_children(alias, key)
    doomed, _ = _start(alias, key, "doomed", ttl=1.0)
    stayer = _start(alias, key, "stayer", ahead=1)
    os.kill(doomed.pid, signal.SIGSTOP)
    try:
        released = time.monotonic()
        assert holder.release()
        store = get_lock_store(alias)
        grant = store.get(key)
        assert grant is not None and grant.holder == "doomed"
        assert grant.expires_in <= 1.0
    finally:
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(5)
    assert stayer[1].poll(10)
    got, fence = stayer[1].recv()
    waited = time.monotonic() - released
    assert got and fence > grant.fence
    assert waited < 1.0 + QUEUE_LEASE, waited  # its grant, then the next look of the stayer


def _counted_waiter(alias: str, key: str, pipe: Connection) -> None:
    """`_waiter`, sending back too the monotonic times of its store calls for `key`."""
    store = get_lock_store(alias)
    calls: list[float] = []
    for name in ("acquire", "acquire_queued", "leave_queue"):
        call = getattr(store, name)

        def counted(*args: Any, _call: Any = call) -> Any:
            calls.append(time.monotonic())
            return _call(*args)

        setattr(store, name, counted)
    handle = lock(key, ttl=30, holder="carried", store=alias)
    handle.is_locked()
    pipe.send("asking")
    got = handle.acquire(timeout=30, retry_delay=RETRY_DELAY)
    pipe.send((got, handle.fence, calls[:]))
    pipe.recv()  # hold it until told
    handle.release()


def test_a_live_waiter_is_handed_the_lock_at_its_ttl_and_holds_it_with_no_call(
    alias: str, key: str
) -> None:
    holder = held_before_children(alias, key)
    parent, child = CONTEXT.Pipe()
    proc = CONTEXT.Process(target=_counted_waiter, args=(alias, key, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(30) and parent.recv() == "asking"
        _in_line(alias, key, 1)
        # MariaDB's listener wakes its waiters as it starts the nap after subscribing the
        # key (a ring may have come meanwhile): the attempt that wake brings, a few ms
        # after the one that stood in line, is over by now.
        time.sleep(0.3)
        released = time.monotonic()
        assert holder.release()
        assert parent.poll(20)
        got, fence, calls = parent.recv()
        grant = get_lock_store(alias).get(key)
        assert got and grant is not None and grant.holder == "carried"
        assert fence == grant.fence > holder.fence
        assert grant.expires_in > QUEUE_LEASE  # its whole ttl, from the release
        assert calls and max(calls) < released  # the wake-up carried it: no call after
        parent.send("release")
        proc.join(10)
        assert get_lock_store(alias).get(key) is None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _given_to_the_next(store: ServerStore, key: str) -> None:
    """Wait until `key`, granted to "b"*32, is given back and so handed to "c"*32, next in
    line (within 10 s: far less than the grant's ttl of 60 s); "c" takes it up, releases."""
    deadline = time.monotonic() + 10
    while (held := store.get(key)) is not None and held.owner == "b" * 32:
        assert time.monotonic() < deadline, f"the grant was kept: {held}"
        time.sleep(0.01)
    assert held is not None and held.owner == "c" * 32
    assert store.acquire_queued(key, "c" * 32, "next", 30).fence == held.fence
    assert store.release(key, "c" * 32)


def _granted_to_one_gone(heard: ServerStore, unheard: ServerStore, key: str) -> None:
    """`key` held, then released with "b"*32 first in line (standing through `heard`, its
    waiter gone: its attempt failed) and "c"*32 next (through `unheard`)."""
    assert unheard.acquire(key, "a" * 32, "holder", 30).acquired
    assert heard.acquire_queued(key, "b" * 32, "gone", 60).fence is None  # then it failed
    _stand(unheard, key, "c" * 32)  # the next in line, in a process that does not listen
    assert unheard.release(key, "a" * 32)


@REDIS_ONLY
def test_a_grant_carried_to_a_waiter_that_left_without_leaving_the_line_is_given_back(
    heard: RedisLockStore, unheard: RedisLockStore, key: str
) -> None:
    # A waiter whose last attempt failed (LockStoreUnavailable: its reply lost, the attempt
    # made) stops without leaving the line: its place lapses within QUEUE_LEASE. A release
    # meanwhile carries it the grant, for its ttl, and its process's listener hears it: with
    # nobody there waiting for the key, that process gives the grant back (the next in line
    # gets it), rather than leave the lock to nobody for the waiter's whole ttl.
    _granted_to_one_gone(heard, unheard, key)
    _given_to_the_next(unheard, key)


@REDIS_ONLY
def test_a_grant_carried_to_a_waiter_that_left_is_given_back_while_others_here_wait_for_the_key(
    heard: RedisLockStore, unheard: RedisLockStore, key: str
) -> None:
    # As above, but another waiter of that process ("d") still watches the key: the grant is
    # for an owner nobody there waits as, so it is given back all the same.
    with heard.watch(key, "d" * 32):
        _granted_to_one_gone(heard, unheard, key)
        _given_to_the_next(unheard, key)
        assert heard.wake_board.take_grant(key, "b" * 32) is None


@REDIS_ONLY
def test_a_grant_its_waiter_stopped_watching_for_without_taking_it_is_given_back(
    heard: RedisLockStore, unheard: RedisLockStore, key: str
) -> None:
    # "b" waits here and the grant reaches the board, but its waiter stops (its store call
    # failed: it does not leave the line) without taking it: the grant is given back when
    # it stops watching, while "d", another waiter of the key here, goes on watching.
    with heard.watch(key, "d" * 32) as other:
        with heard.watch(key, "b" * 32):
            _granted_to_one_gone(heard, unheard, key)
            deadline = time.monotonic() + 10
            while heard.wake_board.granted(key, "b" * 32) is None:
                assert time.monotonic() < deadline, "the grant never came"
                other.wait(0.1)
        _given_to_the_next(unheard, key)
