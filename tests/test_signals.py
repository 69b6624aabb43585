"""Signals (lock_acquired, lock_released, lock_lost, lock_force_released) and the log records
of the "django_keel_lock" logger, from the core and from the surfaces built on it."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.dispatch import Signal
from django.test import Client

from django_keel_lock import Lock, LockNotHeldError, force_release, lock, locked, signals
from tests.conftest import ALL_STORES
from tests.support.holders import PER_PROCESS_STORES, held_elsewhere

Record = tuple[str, dict[str, Any]]


@pytest.fixture
def received() -> Iterator[list[Record]]:
    """Every signal of the package sent during the test, as (signal name, kwargs)."""
    seen: list[Record] = []
    receivers: list[tuple[Signal, Callable[..., None]]] = []
    for name in ("lock_acquired", "lock_released", "lock_lost", "lock_force_released"):
        signal: Signal = getattr(signals, name)

        def receiver(sender: Any, _name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            seen.append((_name, {"sender": sender, **kwargs}))

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield seen
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def names(seen: list[Record]) -> list[str]:
    return [name for name, _ in seen]


def keel_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "django_keel_lock" and r.levelno == level
    ]


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_acquired_and_released_carry_the_handle(
    received: list[Record], store_alias: str, key: str
) -> None:
    handle = lock(key, store=store_alias)
    assert handle.acquire()
    assert handle.release()
    assert names(received) == ["lock_acquired", "lock_released"]
    for _, kwargs in received:
        assert kwargs == {"sender": Lock, "lock": handle}


def test_contention_sends_nothing_and_logs_at_debug(
    received: list[Record], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    holder = lock(key, store="memory")
    assert holder.acquire()
    received.clear()
    with caplog.at_level(logging.DEBUG, logger="django_keel_lock"):
        assert not lock(key, store="memory").acquire()
    assert received == []
    debug = keel_records(caplog, logging.DEBUG)
    assert len(debug) == 1 and key in debug[0] and "held by someone else" in debug[0]
    assert keel_records(caplog, logging.WARNING) == []


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_lost_on_extend_after_takeover_sends_lock_lost_and_warns(
    received: list[Record], store_alias: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    stale = lock(key, store=store_alias, ttl=0.2)
    assert stale.acquire()
    time.sleep(0.35)
    fresh = lock(key, store=store_alias, ttl=30)
    assert fresh.acquire()
    received.clear()
    with caplog.at_level(logging.DEBUG, logger="django_keel_lock"):
        with pytest.raises(LockNotHeldError):
            stale.extend()
    assert names(received) == ["lock_lost"]
    kwargs = received[0][1]
    assert kwargs["lock"] is stale and "extend" in kwargs["reason"]
    warnings = keel_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and key in warnings[0] and "lost" in warnings[0]
    assert fresh.release()


def test_lost_on_release_after_expiry(received: list[Record], key: str) -> None:
    stale = lock(key, store="memory", ttl=0.1)
    assert stale.acquire()
    time.sleep(0.2)
    received.clear()
    assert stale.release() is False
    assert names(received) == ["lock_lost"]
    assert "release" in received[0][1]["reason"]


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_command_release_sends_force_released_and_warns(
    received: list[Record], store_alias: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with held_elsewhere(store_alias, key, ttl=30) as held:
        with caplog.at_level(logging.DEBUG, logger="django_keel_lock"):
            call_command("locks", "release", key, "--store", store_alias, "--yes",
                         stdout=io.StringIO())  # fmt: skip
    if store_alias in PER_PROCESS_STORES:
        # The holder is a handle in this process: it acquired, and its release finds it lost.
        assert names(received) == ["lock_acquired", "lock_force_released", "lock_lost"]
    else:
        assert names(received) == ["lock_force_released"]
    kwargs = next(k for n, k in received if n == "lock_force_released")
    assert kwargs["sender"] is Lock
    assert kwargs["key"] == key and kwargs["store"] == store_alias and kwargs["user"] is None
    assert kwargs["info"].fence == held["fence"] and kwargs["info"].key == key
    warnings = keel_records(caplog, logging.WARNING)
    assert key in warnings[0] and "force-released by a script" in warnings[0]


def test_force_release_names_the_user_and_reports_a_free_key(
    received: list[Record], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    holder = lock(key, store="memory", holder="worker:1")
    assert holder.acquire()
    received.clear()
    with caplog.at_level(logging.DEBUG, logger="django_keel_lock"):
        info = force_release(key, store="memory", user="alice")
        assert force_release(key, store="memory", user="alice") is None
    assert info is not None and info.holder == "worker:1"
    assert [(n, k["user"], k["info"]) for n, k in received] == [
        ("lock_force_released", "alice", info),
        ("lock_force_released", "alice", None),  # nothing was held: info is None
    ]
    warnings = keel_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "alice" in warnings[0] and "worker:1" in warnings[0]


def test_surfaces_send_the_core_signals(received: list[Record], key: str) -> None:
    @locked(key, store="memory")
    def job() -> None:
        pass

    job()
    assert Client().get(f"/views/store/memory/{key}/").status_code == 200
    assert names(received) == ["lock_acquired", "lock_released"] * 2
    assert {kwargs["lock"].key for _, kwargs in received} == {key}


@pytest.mark.parametrize("store", ALL_STORES)
def test_a_receiver_that_raises_is_logged_and_strands_no_lock(
    store: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.lock_acquired.connect(broken, weak=False)
    signals.lock_released.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            with lock(key, store=store) as held:
                assert held.held
            assert lock(key, store=store).run(lambda: "free again") == (True, "free again")
    finally:
        signals.lock_acquired.disconnect(broken)
        signals.lock_released.disconnect(broken)
    errors = [r for r in caplog.records if r.name == "django.dispatch"]
    assert errors and "receiver bug" in errors[0].getMessage()
