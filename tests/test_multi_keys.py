"""Several keys at once (`lock([...])`, `MultiLock`): all or nothing, exclusive against
single-key locks of the same keys, a fence per key, no deadlock whatever order callers ask in,
and everything a single-key handle does, on every store of the contract."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import pytest
from django.conf import settings
from django.core import signing
from django.test import override_settings

from django_keel_lock import (
    InvalidLockToken,
    Lock,
    LockNotHeldError,
    LockStoreUnavailable,
    LockUnavailable,
    MultiLock,
    force_release,
    get_lock_store,
    lock,
    restore_lock,
    signals,
    tokens,
)
from django_keel_lock.options import LockSpec
from django_keel_lock.stores import LockStore
from django_keel_lock.stores.base import MAX_KEYS, AcquireResult
from tests.conftest import CONTRACT_STORES, store_params
from tests.support.third_party_store import DictLockStore

#: The stores that keep a line of waiters per key (`LockStore.queues`).
LINE_STORES = store_params(["postgres", "mariadb", "redis"])

Keys = Callable[..., list[str]]


@pytest.fixture(params=CONTRACT_STORES)
def store_alias(request: pytest.FixtureRequest) -> str:
    """Every store of the contract."""
    if request.param == "etcd":
        request.getfixturevalue("etcd_alias")
    return str(request.param)


@pytest.fixture
def keys(key: str) -> Keys:
    """`keys("a", "b")`: keys of this test alone."""
    return lambda *names: [f"{key}:{name}" for name in names]


@pytest.fixture
def many(store_alias: str) -> Callable[..., MultiLock]:
    def make(names: list[str], **options: object) -> MultiLock:
        options.setdefault("store", store_alias)
        return lock(names, **options)  # type: ignore[call-overload, no-any-return]

    return make


@pytest.fixture
def one(store_alias: str) -> Callable[..., Lock]:
    def make(name: str, **options: object) -> Lock:
        options.setdefault("store", store_alias)
        return lock(name, **options)  # type: ignore[call-overload, no-any-return]

    return make


def test_a_list_takes_every_key_or_none_when_one_is_held_elsewhere(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock], store: LockStore
) -> None:
    a, b, c = keys("a", "b", "c")
    blocker = one(b)
    assert blocker.acquire()
    handle = many([a, b, c])
    assert not handle.acquire()
    assert handle.fences == {} and not handle.held
    assert store.get(a) is None and store.get(c) is None  # nothing taken, nothing left
    assert blocker.release()
    assert handle.acquire()
    assert set(handle.fences) == {a, b, c} and handle.fence == max(handle.fences.values())
    assert all(store.get(k).owner == handle.owner for k in (a, b, c))  # type: ignore[union-attr]
    assert handle.is_owned() and handle.is_locked()
    assert handle.release()
    assert not any(store.get(k) for k in (a, b, c))
    assert handle.fences == {} and not handle.is_locked()


def test_a_multi_key_lock_and_single_key_locks_exclude_each_other(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock]
) -> None:
    a, b = keys("a", "b")
    with many([a, b]):
        assert not one(a).acquire()
        assert not one(b).acquire()
        assert not many([b]).acquire()
    single = one(a)
    assert single.acquire()
    assert not many([a, b]).acquire()
    assert single.release()
    # A single-key waiter wakes when the multi-key holder releases.
    handle = many([a, b], ttl=30)
    assert handle.acquire()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(one(b, ttl=30, timeout=20).acquire()))
    waiter.start()
    time.sleep(0.2)
    assert handle.release()
    waiter.join(25)
    assert got == [True]


def test_duplicates_are_one_key_and_the_order_given_does_not_matter(
    keys: Keys, many: Callable[..., MultiLock]
) -> None:
    a, b = keys("a", "b")
    handle = many([b, a, b])
    assert handle.keys == (a, b) and handle.key == f"{a}+{b}"
    assert isinstance(handle, MultiLock) and isinstance(handle, Lock)
    with handle:
        assert list(handle.fences) == [a, b]
        assert not many((a, b)).acquire()


def test_each_key_gets_a_fence_greater_than_every_earlier_one_of_that_key(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock]
) -> None:
    a, b = keys("a", "b")
    before = {}
    for name in (a, b):
        with one(name) as single:
            before[name] = single.fence
    handle = many([a, b])
    seen = []
    for _ in range(3):
        with handle:
            fences = handle.fences
            assert all(fences[k] > before[k] for k in (a, b)), (fences, before)
            seen.append(fences)
            before = fences
    with one(a) as single:
        assert single.fence is not None and single.fence > seen[-1][a]


def test_two_callers_asking_in_opposite_orders_and_waiting_never_deadlock(
    keys: Keys, many: Callable[..., MultiLock]
) -> None:
    a, b = keys("a", "b")
    rounds, done, errors = 15, [0, 0], []

    def work(which: int, names: list[str]) -> None:
        try:
            for _ in range(rounds):
                handle = many(names, ttl=10)
                assert handle.acquire(timeout=30)
                time.sleep(0.002)
                assert handle.release()
                done[which] += 1
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    threads = [
        threading.Thread(target=work, args=(0, [a, b])),
        threading.Thread(target=work, args=(1, [b, a])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert done == [rounds, rounds]


def test_a_waiter_wakes_when_the_key_that_blocked_it_is_released(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock]
) -> None:
    a, b = keys("a", "b")
    holder = one(b, ttl=30)
    assert holder.acquire()
    got: list[bool] = []
    handle = many([a, b], ttl=30, timeout=20)
    waiter = threading.Thread(target=lambda: got.append(handle.acquire()))
    waiter.start()
    time.sleep(0.2)
    assert holder.release()
    waiter.join(25)
    assert got == [True]
    assert handle.release()


@pytest.mark.parametrize("store_alias", LINE_STORES)
def test_a_waiter_is_not_starved_by_a_stream_of_single_key_waiters(
    keys: Keys, many: Callable[..., MultiLock], store_alias: str
) -> None:
    # Three threads take `b` in turns through its line, each handing it to the next as it
    # releases: `b` is free for moments only. They use a twin of the store (the same
    # server, a listener and a wake address of its own: another process, as far as the
    # line can tell), so a release wakes the multi-key waiter only when the line says so.
    # It stands in `b`'s line too, so its turn comes; it is not left to catch a free
    # moment between two of them with an attempt a second.
    a, b = keys("a", "b")
    twin = {**settings.KEEL_LOCK_STORES, "twin": settings.KEEL_LOCK_STORES[store_alias]}
    stop, errors = threading.Event(), []

    def stream() -> None:
        try:
            while not stop.is_set():
                single = lock(b, store="twin", ttl=10, timeout=10)
                if single.acquire():
                    time.sleep(0.05)
                    single.release()
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    with override_settings(KEEL_LOCK_STORES=twin):
        assert get_lock_store("twin") is not get_lock_store(store_alias)
        assert get_lock_store(store_alias).queues
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for thread in threads:
            thread.start()
        handle = many([a, b], ttl=10)
        try:
            time.sleep(0.2)
            got = handle.acquire(timeout=10)
            released = got and handle.release()
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
    assert got and released and not errors, errors


def test_release_and_extend_cover_every_key(
    keys: Keys, many: Callable[..., MultiLock], store: LockStore
) -> None:
    a, b = keys("a", "b")
    handle = many([a, b], ttl=5)
    assert handle.acquire()
    handle.extend(20)
    assert all(info.expires_in > 10 for info in handle.info().values() if info)
    assert len(handle.info()) == 2 and handle.remaining_time() is not None
    assert handle.release() and not handle.release()
    with pytest.raises(LockNotHeldError):
        handle.extend()
    assert handle.remaining_time() is None and not handle.is_locked()


async def test_the_watchdog_keeps_every_key_alive_from_a_thread_and_from_a_task(
    keys: Keys, many: Callable[..., MultiLock]
) -> None:
    a, b, c, d = keys("a", "b", "c", "d")
    ttl = 0.6  # the watchdog extends every ttl/3; only a lost key ends it early

    def in_a_thread() -> bool:
        with many([a, b], ttl=ttl, auto_extend=True) as handle:
            time.sleep(2.5 * ttl)
            return handle.is_owned() and not handle.lost

    async def in_a_task() -> bool:
        async with many([c, d], ttl=ttl, auto_extend=True) as handle:
            await asyncio.sleep(2.5 * ttl)
            return await handle.ais_owned() and not handle.lost

    assert await asyncio.gather(asyncio.to_thread(in_a_thread), in_a_task()) == [True, True]
    assert not await many([a, b, c, d]).ais_locked()


def test_one_key_force_released_loses_the_lock_and_gives_back_the_others(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock], store_alias: str
) -> None:
    a, b, c = keys("a", "b", "c")
    lost: list[MultiLock] = []
    handle = many([a, b, c], ttl=30, on_lost=lost.append)
    assert handle.acquire()
    assert force_release(b, store=store_alias) is not None
    with pytest.raises(LockNotHeldError):
        handle.extend()
    assert lost == [handle] and handle.lost and not handle.held
    # The keys it still held are given back (on the store's worker threads): free soon.
    assert one(a, timeout=10).acquire()
    assert one(c, timeout=10).acquire()


def test_is_owned_finds_a_stolen_key_and_the_lost_signal_names_the_handle(
    keys: Keys, many: Callable[..., MultiLock], store_alias: str
) -> None:
    a, b = keys("a", "b")
    seen: list[object] = []

    def receiver(lock: object, **kwargs: object) -> None:
        seen.append(lock)

    signals.lock_lost.connect(receiver)
    try:
        handle = many([a, b], ttl=30, on_lost="warn")
        assert handle.acquire()
        force_release(a, store=store_alias)
        assert not handle.is_owned()
    finally:
        signals.lock_lost.disconnect(receiver)
    assert seen == [handle]
    assert many([a, b], timeout=10).acquire()


def test_serialize_and_restore_hand_over_every_key(
    keys: Keys, many: Callable[..., MultiLock], store: LockStore
) -> None:
    a, b = keys("a", "b")
    handle = many([b, a], ttl=30)
    assert handle.acquire()
    restored = restore_lock(handle.serialize())
    assert isinstance(restored, MultiLock)
    assert restored.keys == (a, b) and restored.fences == handle.fences
    assert restored.owner == handle.owner and restored.is_owned()
    restored.extend(30)
    assert restored.release()
    assert store.get(a) is None and store.get(b) is None


async def test_async_with_and_a_cancelled_wait_leave_no_key_held(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock], store: LockStore
) -> None:
    a, b, c = keys("a", "b", "c")
    async with many([a, b], ttl=30) as handle:
        assert set(handle.fences) == {a, b}
        assert await handle.ais_owned() and await handle.ais_locked()
        assert set(await handle.aholders()) == {a, b}
    blocker = one(c, ttl=30)
    assert await blocker.aacquire()
    waiter = many([a, b, c], ttl=30, timeout=30)
    task = asyncio.ensure_future(waiter.aacquire())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await blocker.arelease()
    assert not await many([a, b, c]).ais_locked()
    # A task waiting for the keys wakes when the one that blocked it is released.
    assert await blocker.aacquire()
    later = many([a, b, c], ttl=30, timeout=20)
    waiting = asyncio.ensure_future(later.aacquire())
    await asyncio.sleep(0.2)
    assert await blocker.arelease()
    assert await waiting
    assert await later.arelease()
    ran, value = await many([a, c], ttl=30).arun(lambda: 7)
    assert (ran, value) == (True, 7)


@pytest.mark.parametrize("store_alias", LINE_STORES)
async def test_a_waiter_cancelled_as_it_takes_its_keys_from_a_line_leaves_none_held(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock], store: LockStore
) -> None:
    # The waiter stands in `a`'s line; `a` released, it takes both keys and then leaves the
    # line. A cancellation that lands at any moment of that (each count of loop turns
    # after the release) must leave no key held: taken, they are given back.
    a, b = keys("a", "b")
    held: list[tuple[int, object, object]] = []
    for turns in range(16):
        blocker = one(a, ttl=30)
        assert await blocker.aacquire()
        waiter = many([a, b], ttl=30, timeout=10)
        task = asyncio.ensure_future(waiter.aacquire())
        await asyncio.sleep(0.05)
        assert await blocker.arelease()
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            if await task:
                await waiter.arelease()
        left = (await store.aget(a), await store.aget(b))
        if left != (None, None):
            held.append((turns, *left))
            for name in (a, b):
                await asyncio.to_thread(force_release, name, store=store.alias)
    assert held == []


def test_a_refused_with_block_raises_lock_unavailable_naming_the_keys(
    keys: Keys, many: Callable[..., MultiLock], one: Callable[..., Lock]
) -> None:
    a, b = keys("a", "b")
    with one(a), pytest.raises(LockUnavailable, match="multi-key lock"):
        with many([a, b]):
            pass


# -- bad input (the store does not matter: one run) -------------------------------------------
@pytest.mark.parametrize("store_alias", ["memory"])
@pytest.mark.parametrize(
    ("given", "error", "words"),
    [
        ([], ValueError, "keys must name at least one key"),
        ((), ValueError, "keys must name at least one key"),
        ([f"k{i}" for i in range(MAX_KEYS + 1)], ValueError, f"at most {MAX_KEYS}"),
        (["a", 3], TypeError, r"keys\[1\]"),
        (["a", "bad\nkey"], ValueError, r"keys\[1\]"),
        (["a", ""], ValueError, r"keys\[1\]"),
        # Several keys in another collection: told to pass a list or tuple, not "a str".
        ({"a", "b"}, TypeError, "list or tuple of str.*got set"),
        (frozenset({"a"}), TypeError, "list or tuple of str.*got frozenset"),
        ((k for k in "ab"), TypeError, "list or tuple of str.*got generator"),
        ({"a": 1}.keys(), TypeError, "list or tuple of str.*got dict_keys"),
    ],
)
def test_bad_keys_are_refused_naming_the_argument(
    store_alias: str, given: list[object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        lock(given, store=store_alias)  # type: ignore[call-overload]


@pytest.mark.parametrize("store_alias", ["memory"])
def test_a_key_too_long_for_the_store_is_refused_naming_it(store_alias: str) -> None:
    long = "x" * 300
    with pytest.raises(ValueError, match=r"keys\[1\].*at most"):
        lock(["a", long], store="sqlite")


@pytest.mark.parametrize("store_alias", ["memory"])
def test_at_most_max_keys_distinct_keys_duplicates_not_counted(store_alias: str) -> None:
    names = [f"k{i}" for i in range(MAX_KEYS)]
    assert len(lock(names + names, store=store_alias).keys) == MAX_KEYS


@pytest.mark.parametrize("store_alias", ["memory"])
def test_shared_and_limit_are_refused_for_several_keys(store_alias: str) -> None:
    with pytest.raises(ValueError, match="shared=True"):
        lock(["a", "b"], shared=True, store=store_alias)
    with pytest.raises(TypeError, match="limit"):
        lock(["a", "b"], limit=2, store=store_alias)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="shared=True"):
        MultiLock.from_spec(["a", "b"], LockSpec.parse(shared=True, store=store_alias))
    with pytest.raises(TypeError, match="keys must be a list or tuple"):
        MultiLock.from_spec("ab", LockSpec.parse(store=store_alias))


@pytest.mark.parametrize("store_alias", ["memory"])
def test_from_spec_and_the_name(store_alias: str) -> None:
    spec = LockSpec.parse(store=store_alias, ttl=5)
    handle = MultiLock.from_spec(["account:2", "account:1"], spec, label="transfer")
    assert handle.keys == ("account:1", "account:2")
    assert handle.name == "account:*+account:*" and handle.ttl == 5
    assert "transfer" in handle.holder
    named = lock(["account:1", "account:2"], name="transfer", store=store_alias)
    assert named.name == "transfer"


@pytest.mark.parametrize("store_alias", ["memory"])
@pytest.mark.parametrize(
    "extra", [{"K": ["a", "b"]}, {"K": ["a", "b"], "F": [1]}, {"K": ["a", 2], "F": [1, 2]}]
)
def test_a_signed_token_with_keys_but_not_a_fence_each_is_refused(
    store_alias: str, extra: dict[str, object]
) -> None:
    single = lock("a", store=store_alias, ttl=5)
    assert single.acquire()
    payload = signing.loads(single.serialize(), salt=tokens.TOKEN_SALT)
    assert "K" not in payload  # a single key's token is as it was
    forged = signing.dumps({**payload, **extra}, salt=tokens.TOKEN_SALT, compress=True)
    with pytest.raises(InvalidLockToken, match="does not describe a lock"):
        restore_lock(forged)
    assert single.release()


class _OneKeyDown(DictLockStore):
    """A store (written on the documented default `release_many`) one of whose keys cannot
    be released: the shard that keeps it is down."""

    down = ""

    def release(self, key: str, owner: str) -> bool:
        if key == self.down:
            raise LockStoreUnavailable(f"the shard of {key!r} is down")
        return super().release(key, owner)


def test_the_default_release_many_frees_every_key_it_can_when_one_fails() -> None:
    store = _OneKeyDown("one-key-down")
    keys = ("a", "b", "c")
    assert store.acquire_many(keys, "mine", "here", 30).acquired
    store.down = "a"
    with pytest.raises(LockStoreUnavailable, match="'a'"):
        store.release_many(keys, "mine")
    assert store.get("b") is None and store.get("c") is None


class _RefusedThenDown(DictLockStore):
    """A store with a line of waiters whose multi-key acquire is refused once, by the first
    key (held, as its release comes), and then cannot reach its server."""

    queues = True

    def __init__(self, alias: str = "default", options: object = None) -> None:
        super().__init__(alias, options)  # type: ignore[arg-type]
        self.asked = 0

    def acquire_many(
        self, keys: tuple[str, ...], owner: str, holder: str, ttl: float
    ) -> AcquireResult:
        self.asked += 1
        if self.asked == 1:
            return AcquireResult(None, 0.1, "exclusive", None, (keys[0],))
        raise LockStoreUnavailable("the server went down")

    def acquire_queued(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        return self.acquire(key, owner, holder, ttl)  # the line: nobody else in it

    def leave_queue(self, key: str, owner: str) -> None:
        pass


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_key_taken_from_its_line_is_given_back_when_the_store_then_fails(
    keys: Keys, use_async: bool
) -> None:
    # Refused by `a`, the waiter stands in `a`'s line and the line gives it `a`; asked for
    # both keys then, the store fails: the waiter must not keep `a` until its ttl.
    a, b = keys("a", "b")
    stores = {**settings.KEEL_LOCK_STORES, "down": {"BACKEND": f"{__name__}._RefusedThenDown"}}
    with override_settings(KEEL_LOCK_STORES=stores):
        handle = lock([a, b], store="down", ttl=30)
        with pytest.raises(LockStoreUnavailable):
            if use_async:
                asyncio.run(handle.aacquire(timeout=5))
            else:
                handle.acquire(timeout=5)
        assert get_lock_store("down").get(a) is None


class _LostReply(DictLockStore):
    """A store (on the documented default `acquire_many`) whose acquire of one key takes it
    and then loses the reply: the caller gets an error, the key is held."""

    lost = ""

    def acquire(self, key: str, owner: str, holder: str, ttl: float) -> AcquireResult:
        result = super().acquire(key, owner, holder, ttl)
        if key == self.lost:
            raise LockStoreUnavailable(f"the reply for {key!r} was lost")
        return result


def test_the_default_acquire_many_gives_back_the_key_whose_reply_was_lost() -> None:
    store = _LostReply("lost-reply")
    store.lost = "b"
    with pytest.raises(LockStoreUnavailable, match="'b'"):
        store.acquire_many(("a", "b", "c"), "mine", "here", 30)
    assert store.get("a") is None and store.get("b") is None and store.get("c") is None
