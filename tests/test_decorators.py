"""@locked on sync and async functions, against real stores."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import multiprocessing
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.test import override_settings

from django_keel_lock import (
    LockNotHeldError,
    LockStoreUnavailable,
    LockUnavailable,
    lock,
    locked,
)
from django_keel_lock.conf import conf
from django_keel_lock.options import binder_of, format_key
from tests.conftest import ALL_STORES, store_params
from tests.support.holders import held_elsewhere, takeovers

DOWN_STORES = {"down": {"BACKEND": "django_keel_lock.stores.RedisLockStore",
                        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}}  # fmt: skip


def holder_of(key: str, store: str = "memory") -> str | None:
    info = lock(key, store=store).info()
    return None if info is None else info.holder


def test_key_is_formatted_from_bound_arguments_and_held_during_the_call(key: str) -> None:
    seen: list[Any] = []

    @locked(key + ":{date}:{kind}", store="memory", ttl=60)
    def build(date: str, kind: str = "daily") -> str:
        seen.append(holder_of(f"{key}:{date}:{kind}"))
        return f"built {date}"

    assert build("2024-05-01") == "built 2024-05-01"
    assert build(date="2024-05-02", kind="weekly") == "built 2024-05-02"
    assert len(seen) == 2 and all(seen)
    # The holder names the function, for `locks list` readers.
    assert "test_decorators" in seen[0] and "build" in seen[0]
    assert holder_of(f"{key}:2024-05-01:daily") is None


def test_attribute_and_callable_keys(key: str) -> None:
    class Account:
        pk = 7

    @locked(key + ":{account.pk}", store="memory")
    def sync_account(account: Account) -> int:
        return 1 if holder_of(f"{key}:7") else 0

    @locked(lambda n: f"{key}:n{n}", store="memory")
    def numbered(n: int) -> bool:
        return holder_of(f"{key}:n{n}") is not None

    assert sync_account(Account()) == 1
    assert numbered(3) is True


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_raise_and_skip_when_another_process_holds_the_key(
    store_alias: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    @locked("{name}", store=store_alias)
    def strict(name: str) -> str:
        calls.append(name)
        return "ran"

    @locked("{name}", store=store_alias, on_locked="skip")
    def lenient(name: str) -> str:
        calls.append(name)
        return "ran"

    with held_elsewhere(store_alias, key):
        with pytest.raises(LockUnavailable) as info:
            strict(key)
        assert info.value.key == key
        assert "strict" in str(info.value)
        with caplog.at_level(logging.INFO, logger="django_keel_lock"):
            assert lenient(key) is None
    assert calls == []
    skipped = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(skipped) == 1 and key in skipped[0].getMessage()
    assert "lenient" in skipped[0].getMessage()
    assert strict(key) == "ran" and lenient(key) == "ran"
    assert calls == [key, key]


def test_timeout_waits_for_the_holder(key: str) -> None:
    holder = lock(key, store="memory", ttl=60)
    assert holder.acquire()
    threading.Timer(0.3, holder.release).start()

    @locked(key, store="memory", timeout=5)
    def job() -> str:
        return "done"

    started = time.monotonic()
    assert job() == "done"
    assert time.monotonic() - started >= 0.25


def test_exception_propagates_and_releases(key: str) -> None:
    @locked(key, store="memory")
    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert holder_of(key) is None


def test_concurrent_callers_one_runs_the_other_skips(key: str) -> None:
    inside, leave = threading.Event(), threading.Event()

    @locked(key, store="memory", on_locked="skip")
    def job() -> str:
        inside.set()
        leave.wait(5)
        return "ran"

    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(job()))
    thread.start()
    try:
        assert inside.wait(5)
        assert job() is None
    finally:
        leave.set()
        thread.join(5)
    assert results == ["ran"]


@override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES})
def test_store_outage_raises_even_with_skip(key: str) -> None:
    calls: list[int] = []

    @locked(key, store="down", on_locked="skip")
    def job() -> None:
        calls.append(1)

    with pytest.raises(LockStoreUnavailable):
        job()
    assert calls == []


@pytest.mark.parametrize("bad", ["ignore", "Skip", None, True])
def test_on_locked_must_be_raise_or_skip(bad: Any) -> None:
    with pytest.raises(ValueError, match='on_locked must be "raise" or "skip"'):
        locked("k", on_locked=bad)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"ttl": 0}, ValueError), ({"timeout": -1}, ValueError), ({"store": None}, TypeError)],
)
def test_bad_options_fail_at_decoration(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        locked("k", **kwargs)


def test_template_naming_a_missing_argument_is_a_clear_error_at_decoration(key: str) -> None:
    with pytest.raises(ValueError, match=r"\{day\}.*its parameters: date\); name one of them"):

        @locked("report:{day}", store="memory")
        def report(date: str) -> None:  # pragma: no cover
            pass


def test_holder_and_ttl_pass_through(key: str) -> None:
    @locked(key, store="memory", holder="nightly-cron", ttl="90s")
    def job() -> tuple[str | None, float | None]:
        return holder_of(key), lock(key, store="memory").remaining_time()

    holder, remaining = job()
    assert holder == "nightly-cron"
    assert remaining is not None and 85 < remaining <= 90


def test_wraps_keeps_name_and_coroutine_nature() -> None:
    @locked("k")
    def plain() -> None: ...

    @locked("k")
    async def coro() -> None: ...

    assert plain.__name__ == "plain" and coro.__name__ == "coro"
    assert not iscoroutinefunction(plain)
    assert iscoroutinefunction(coro)


# -- async functions ------------------------------------------------------------------------
async def test_async_function_holds_the_lock_while_awaited(key: str) -> None:
    @locked(key + ":{n}", store="memory")
    async def job(n: int) -> str | None:
        await asyncio.sleep(0)
        return holder_of(f"{key}:{n}")

    assert await job(1)
    assert holder_of(f"{key}:1") is None


@pytest.mark.parametrize("store_alias", ALL_STORES)
async def test_async_raise_and_skip_when_another_process_holds(store_alias: str, key: str) -> None:
    calls: list[str] = []

    @locked("{name}", store=store_alias)
    async def strict(name: str) -> str:
        calls.append(name)
        return "ran"

    @locked("{name}", store=store_alias, on_locked="skip")
    async def lenient(name: str) -> str:
        calls.append(name)
        return "ran"

    with held_elsewhere(store_alias, key):
        with pytest.raises(LockUnavailable):
            await strict(key)
        assert await lenient(key) is None
    assert calls == []
    assert await strict(key) == "ran"
    assert await sync_to_async(holder_of)(key, store_alias) is None


async def test_async_concurrent_tasks_one_runs(key: str) -> None:
    started = asyncio.Event()

    @locked(key, store="memory", on_locked="skip")
    async def job(n: int) -> int:
        started.set()
        await asyncio.sleep(0.2)
        return n

    first = asyncio.ensure_future(job(1))
    await started.wait()
    assert await job(2) is None
    assert await first == 1


async def test_async_exception_releases(key: str) -> None:
    @locked(key, store="memory")
    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await fails()
    assert holder_of(key) is None


def test_async_store_outage_raises_even_with_skip(key: str) -> None:
    @locked(key, store="down", on_locked="skip")
    async def job() -> None:  # pragma: no cover
        raise AssertionError("must not run")

    # Settings change outside the event loop: closing the stores it resets is sync-only.
    with override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES}):
        with pytest.raises(LockStoreUnavailable):
            async_to_sync(job)()


def test_locked_refuses_generator_functions_at_decoration() -> None:
    with pytest.raises(TypeError, match=r"cannot wrap the generator function .*rows"):

        @locked("export", store="memory")
        def rows() -> Any:
            yield 1

    with pytest.raises(TypeError, match=r"cannot wrap the generator function .*arows"):

        @locked("export", store="memory")
        async def arows() -> Any:
            yield 1


# -- auto_extend and max_hold ---------------------------------------------------------------
#: A ttl the function outlives three times over, and a max_hold in between.
TTL, RUN, MAX_HOLD = 0.5, 1.5, 1.0
EXTEND_STORES = store_params(["memory", "redis"])


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_auto_extend_keeps_the_lock_while_the_function_outlives_its_ttl(
    store_alias: str, key: str
) -> None:
    @locked(key, store=store_alias, ttl=TTL, auto_extend=True)
    def long_job() -> list[float]:
        return takeovers(store_alias, key, RUN)

    assert long_job() == []  # and no LockNotHeldError on the way out
    assert holder_of(key, store_alias) is None


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_without_auto_extend_the_function_loses_the_lock_at_its_ttl(
    store_alias: str, key: str
) -> None:
    taken: list[float] = []

    @locked(key, store=store_alias, ttl=TTL)
    def long_job() -> None:
        taken.extend(takeovers(store_alias, key, RUN, until_taken=True))

    with pytest.raises(LockNotHeldError):
        long_job()
    assert len(taken) == 1 and TTL * 0.9 <= taken[0] < TTL + 0.4


@pytest.mark.parametrize("store_alias", EXTEND_STORES)
def test_max_hold_stops_the_renewal_and_the_function_loses_the_lock(
    store_alias: str, key: str
) -> None:
    taken: list[float] = []

    @locked(key, store=store_alias, ttl=TTL, auto_extend=True, max_hold=MAX_HOLD)
    def long_job() -> None:
        taken.extend(takeovers(store_alias, key, RUN, until_taken=True))

    with pytest.raises(LockNotHeldError, match="max_hold"):
        long_job()
    # Kept past its ttl, lost at max_hold.
    assert len(taken) == 1 and MAX_HOLD * 0.9 <= taken[0] < MAX_HOLD + 0.4


async def test_async_auto_extend_runs_until_max_hold_then_the_body_is_cancelled(
    key: str,
) -> None:
    outsider = lock(key, store="memory", ttl=60)

    @locked(key, store="memory", ttl=TTL, auto_extend=True, max_hold=MAX_HOLD)
    async def long_job() -> None:
        await asyncio.sleep(TTL * 1.5)
        assert not outsider.acquire(), "the lock expired at its ttl"
        await asyncio.sleep(10)

    started = time.monotonic()
    with pytest.raises(LockNotHeldError, match="max_hold"):
        await long_job()
    assert MAX_HOLD * 0.9 <= time.monotonic() - started < MAX_HOLD + 0.5


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"auto_extend": "yes"}, TypeError, "auto_extend must be True or False, got 'yes'"),
        ({"max_hold": 60}, ValueError, "max_hold caps how long auto_extend keeps a lock alive"),
        ({"auto_extend": True, "max_hold": -1}, ValueError, "max_hold must be > 0"),
        ({"auto_extend": True, "max_hold": "soon"}, ValueError, "max_hold could not be parsed"),
    ],
)
def test_bad_auto_extend_and_max_hold_fail_at_decoration_naming_them(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        locked("k", **kwargs)


# -- several keys at once: @locked([...]) ----------------------------------------------------
@pytest.mark.parametrize("store_alias", store_params(["memory", "postgres", "redis"]))
def test_a_list_of_templates_holds_every_key_they_name_during_the_call(
    store_alias: str, key: str
) -> None:
    seen: list[Any] = []

    @locked([key + ":{target}", key + ":{source}"], store=store_alias, ttl=60)
    def transfer(source: int, target: int, amount: int) -> int:
        seen.extend(lock(f"{key}:{n}", store=store_alias).is_locked() for n in (source, target))
        seen.append(lock(f"{key}:{source}", store=store_alias).acquire())
        return amount

    assert transfer(1, 2, amount=5) == 5
    assert seen == [True, True, False]
    assert not lock(f"{key}:1", store=store_alias).is_locked()
    assert not lock(f"{key}:2", store=store_alias).is_locked()


def test_a_list_of_templates_raises_or_skips_when_one_key_is_held(key: str) -> None:
    calls: list[int] = []

    @locked([key + ":{a}", key + ":{b}"], store="memory")
    def strict(a: int, b: int) -> None:
        calls.append(1)

    @locked([key + ":{a}", key + ":{b}"], store="memory", on_locked="skip")
    def lenient(a: int, b: int) -> str:
        calls.append(2)
        return "ran"

    other = lock(f"{key}:2", store="memory")
    assert other.acquire()
    with pytest.raises(LockUnavailable, match=f"{key}:1\\+{key}:2"):
        strict(1, 2)
    assert lenient(2, 1) is None and calls == []
    assert other.release()
    assert lenient(2, 1) == "ran"


async def test_async_function_with_a_list_of_templates_holds_every_key(key: str) -> None:
    @locked([key + ":{a}", key + ":{b}"], store="memory")
    async def job(a: int, b: int) -> list[bool]:
        await asyncio.sleep(0)
        return [await lock(f"{key}:{n}", store="memory").ais_locked() for n in (a, b)]

    assert await job(3, 4) == [True, True]
    assert not await lock(f"{key}:3", store="memory").ais_locked()


@pytest.mark.parametrize(
    ("templates", "error", "message"),
    [
        ([], ValueError, "key must name at least one key template, got an empty list"),
        (("a:{x}", 3), TypeError, r"key\[1\]: key must be a str template or a callable"),
        (["a:{x}", "b:{nope}"], ValueError, r"names \{nope\}, which .*f does not take"),
    ],
)
def test_a_bad_list_of_templates_fails_at_decoration_naming_it(
    templates: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):

        @locked(templates, store="memory")
        def f(x: int) -> None: ...


def test_locked_key_of_a_function_made_on_the_fly_does_not_keep_it_alive(key: str) -> None:
    """The signature a key template binds each call's arguments to is worked out once per
    function and held weakly: a decorated function made on the fly (a closure, a factory's)
    goes when nothing else refers to it."""

    def make() -> Callable[[int], int]:
        @locked(key + ":{n}", store="memory")
        def job(n: int) -> int:
            return n * 2

        return job

    job = make()
    assert job(21) == 42
    assert job(n=4) == 8  # the same signature, bound by keyword
    undecorated = weakref.ref(job.__wrapped__)  # type: ignore[attr-defined]
    del job
    gc.collect()
    assert undecorated() is None


def test_key_of_an_unhashable_callable_is_still_formatted(key: str) -> None:
    """A callable that cannot be a cache key (unhashable) has its signature worked out at
    each call, as before (`format_key`, which `@locked` and `locked_task` use)."""

    class Job:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, n: int) -> int:
            return n + 1

    job = Job()
    assert format_key(key + ":{n}", job, (1,), {}) == key + ":1"
    assert format_key(key + ":{n}", job, (), {"n": 2}) == key + ":2"


def _holder_in_child(job: Callable[[], str | None], pipe: Any) -> None:
    pipe.send((os.getpid(), job()))


def test_locked_holder_names_the_process_that_calls_even_a_forked_child(key: str) -> None:
    """A call's holder (`<hostname>:<pid> <function>`, made once per function in a process)
    names the pid of the process that calls: a child forked after the parent's calls names
    its own."""

    @locked(key, store="memory")
    def job() -> str | None:
        return holder_of(key)

    parent = job()
    assert parent is not None and f":{os.getpid()} " in parent and "job" in parent
    receiving, sending = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_holder_in_child, args=(job, sending)
    )
    child.start()
    assert receiving.poll(30)
    pid, holder = receiving.recv()
    child.join(30)
    assert pid == child.pid and holder is not None
    assert f":{pid} " in holder and "job" in holder
    assert job() == parent


def _plain(a: int, b: int = 2, c: object = None) -> None: ...


def _mixed(a: int, /, b: int = 2, *more: int, c: int = 3, **rest: int) -> None: ...


@pytest.mark.parametrize("fn", [_plain, _mixed], ids=["plain", "positional-only and gathering"])
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        ((1, 5), {}),
        ((1, 5, 7), {}),
        ((), {"a": 1}),
        ((1,), {"c": 9}),
        ((1,), {"b": 4, "c": 9}),
        ((), {"b": 4, "c": 9, "a": 1}),
        ((), {}),  # a required argument missing
        ((1,), {"a": 1}),  # given twice
        ((1, 2, 3, 4), {}),  # one too many (for _plain)
        ((1,), {"d": 1}),  # unknown (for _plain)
    ],
)
def test_key_arguments_bind_as_the_signature_binds_them(
    fn: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The arguments a key template is formatted with are those `inspect.Signature.bind`
    gives (defaults applied, in the parameters' order), for a plain function, which binds by
    a short cut, and for one whose parameters are of the other kinds; a call that does not
    fit is the same TypeError."""
    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        with pytest.raises(TypeError, match=re.escape(str(exc))):
            format_key("k:{a}", fn, args, kwargs)
        return
    bound.apply_defaults()
    got = binder_of(fn).arguments(args, kwargs)
    assert list(got.items()) == list(bound.arguments.items())
    if "a" in bound.arguments:
        expected = f"k:{bound.arguments['a']}:{bound.arguments['b']}"
        assert format_key("k:{a}:{b}", fn, args, kwargs) == expected
    else:  # Python 3.13 binds a positional-only name given by keyword to **rest
        with pytest.raises(ValueError, match="cannot be formatted"):
            format_key("k:{a}:{b}", fn, args, kwargs)
