"""SQLite's doorbells: a release wakes the waiters of other processes on the machine at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.doorbells import SUN_PATH_MAX, Doorbells, digest
from tests.testapp.models import Invoice

from .conftest import database_like
from .support import ROOT

# A waiter polls every 5 s (2.5 s at the soonest, with its jitter): one that acquires sooner
# than this after the release was woken by it.
POLL = 5.0
WOKEN_WITHIN = 0.2
FORK = multiprocessing.get_context("fork")


def _bells(alias: str) -> Doorbells:
    bells = get_lock_store(alias).doorbells()  # type: ignore[attr-defined]
    assert bells is not None
    return bells


def _hung(alias: str, key: str) -> list[str]:
    """The names of the bells hung for `key` (one per waiting process)."""
    try:
        return sorted(os.listdir(_bells(alias).key_dir(digest(key))))
    except FileNotFoundError:
        return []


def _until(condition: Any, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds:g} s for {what}"
        time.sleep(0.01)


def _wait_in_child(
    alias: str, key: str, limit: int, retry_delay: float, awaits: bool, out: Connection
) -> None:
    """In a forked child: wait for `key` (a semaphore of `limit` permits if `limit`; in an
    event loop if `awaits`), say when it was acquired and whether the store could hang bells,
    then release."""
    handle = (
        semaphore(key, limit=limit, ttl=30, store=alias)
        if limit
        else lock(key, ttl=30, store=alias)
    )
    if awaits:
        acquired = asyncio.run(handle.aacquire(timeout=30, retry_delay=retry_delay))
    else:
        acquired = handle.acquire(timeout=30, retry_delay=retry_delay)
    at = time.monotonic()
    store = get_lock_store(alias)
    out.send({"acquired": acquired, "at": at, "bells": store.push_possible})  # type: ignore[attr-defined]
    if acquired:
        handle.release()


@contextmanager
def waiting_child(
    alias: str, key: str, *, limit: int = 0, retry_delay: float = POLL, awaits: bool = False
) -> Iterator[tuple[Any, Connection]]:
    """A forked child waiting for `key`; (the process, the end it reports on)."""
    ours, theirs = FORK.Pipe()
    args = (alias, key, limit, retry_delay, awaits, theirs)
    child = FORK.Process(target=_wait_in_child, args=args)
    child.start()
    try:
        yield child, ours
    finally:
        child.kill()
        child.join(10)


def _released_then_acquired(holder: Any, report: Connection) -> float:
    """Release `holder`; seconds until the child's acquire returned."""
    released_at = time.monotonic()
    assert holder.release()
    assert report.poll(30), "the child never acquired"
    result = report.recv()
    assert result["acquired"] is True
    return float(result["at"] - released_at)


@pytest.mark.parametrize("awaits", [False, True], ids=["acquire", "aacquire"])
def test_a_waiter_in_another_process_acquires_as_soon_as_the_lock_is_released(
    awaits: bool, key: str
) -> None:
    holder = lock(key, ttl=30, store="sqlite")
    assert holder.acquire()
    with waiting_child("sqlite", key, awaits=awaits) as (_, report):
        _until(lambda: _hung("sqlite", key), "the child's bell")
        time.sleep(0.3)  # its first attempt was refused: it sleeps on its 5 s poll
        assert lock(f"{key}:other", store="sqlite").run(lambda: None)[0]  # rings nobody there
        assert not report.poll(0)
        assert _released_then_acquired(holder, report) < WOKEN_WITHIN


def test_a_permit_release_wakes_a_semaphore_waiter_in_another_process(key: str) -> None:
    permits = [semaphore(key, limit=2, ttl=30, store="sqlite") for _ in range(2)]
    assert all(permit.acquire() for permit in permits)
    with waiting_child("sqlite", key, limit=2) as (_, report):
        _until(lambda: _hung("sqlite", key), "the child's bell")
        time.sleep(0.3)
        assert _released_then_acquired(permits[0], report) < WOKEN_WITHIN
    assert permits[1].release()


def test_a_killed_waiters_bell_neither_breaks_a_release_nor_stays(key: str) -> None:
    holder = lock(key, ttl=30, store="sqlite")
    assert holder.acquire()
    root = _bells("sqlite").root
    with waiting_child("sqlite", key) as (_, report):
        _until(lambda: len(_hung("sqlite", key)) == 1, "the live child's bell")
        with waiting_child("sqlite", key) as (killed, _):
            _until(lambda: len(_hung("sqlite", key)) == 2, "the second child's bell")
            killed.kill()
            killed.join(10)
        dead = [name for name in _hung("sqlite", key) if name.startswith(f"{killed.pid}-")]
        assert dead and os.path.exists(os.path.join(root, dead[0]))  # SIGKILL left it there
        time.sleep(0.3)
        assert _released_then_acquired(holder, report) < WOKEN_WITHIN
        assert dead[0] not in _hung("sqlite", key)
        assert not os.path.exists(os.path.join(root, dead[0]))


def test_a_waiter_that_leaves_takes_its_bell_down_and_an_exiting_process_its_socket(
    key: str,
) -> None:
    store = get_lock_store("sqlite")
    with store.watch(key):
        _until(lambda: _hung("sqlite", key), "our bell")
        ours = _hung("sqlite", key)
    assert ours[0].startswith(f"{os.getpid()}-")
    _until(lambda: not _hung("sqlite", key), "our bell taken down")

    holder = lock(key, ttl=30, store="sqlite")
    assert holder.acquire()
    command = ["acquire", "--store", "sqlite", "--key", key, "--timeout", "1"]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.child", *command, "--retry-delay", "5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _until(lambda: _hung("sqlite", key), "the child's bell")
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        holder.release()
    assert '"acquired": false' in out  # it timed out, then exited
    root = _bells("sqlite").root
    assert _hung("sqlite", key) == []
    assert [name for name in os.listdir(root) if name.startswith(f"{child.pid}-")] == []


@contextmanager
def sqlite_store(path: Path, alias: str) -> Iterator[str]:
    """The lock store `alias` on a new, migrated SQLite database at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stores = {alias: {"BACKEND": "django_keel_lock.stores.DatabaseLockStore",
                      "OPTIONS": {"DATABASE": alias}}}  # fmt: skip
    with (
        database_like("default", alias, NAME=str(path)),
        override_settings(KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, **stores}),
    ):
        call_command("migrate", "django_keel_lock", database=alias, verbosity=0)
        try:
            yield alias
        finally:
            get_lock_store(alias).close()


def test_a_bell_directory_that_cannot_be_used_leaves_waiters_polling(
    key: str, tmp_path: Path
) -> None:
    database = tmp_path / "locks.sqlite3"
    with sqlite_store(database, "nobells") as alias:
        root = Path(str(database) + ".keel-bells")
        root.write_text("")  # a file where the directory would be
        holder = lock(key, ttl=30, store=alias)
        assert holder.acquire()
        with waiting_child(alias, key, retry_delay=0.05) as (_, report):
            time.sleep(0.5)
            released_at = time.monotonic()
            assert holder.release()
            assert report.poll(30), "the child never acquired"
            result = report.recv()
    assert result["acquired"] is True and result["bells"] is False
    assert result["at"] > released_at
    assert root.is_file()


def test_a_database_whose_path_is_too_long_for_a_socket_rings_bells_in_the_temp_dir(
    key: str, tmp_path: Path
) -> None:
    database = tmp_path / ("d" * SUN_PATH_MAX) / "locks.sqlite3"
    with sqlite_store(database, "longpath") as alias:
        root = _bells(alias).root
        holder = lock(key, ttl=30, store=alias)
        assert holder.acquire()
        bell = ""
        try:
            with waiting_child(alias, key) as (_, report):
                _until(lambda: _hung(alias, key), "the child's bell")
                time.sleep(0.3)
                bell = os.readlink(
                    os.path.join(_bells(alias).key_dir(digest(key)), _hung(alias, key)[0])
                )
                assert len(bell) <= SUN_PATH_MAX and not bell.startswith(root)
                assert _released_then_acquired(holder, report) < WOKEN_WITHIN
        finally:
            if bell:  # outside tmp_path: the killed child's bell is left there
                shutil.rmtree(os.path.dirname(bell), True)


@pytest.mark.parametrize("name", [":memory:", "file:keel_bells_memory?mode=memory&cache=shared"])
def test_in_memory_databases_hang_no_bells(name: str, key: str, tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where a bell directory for ":memory:" would go
    try:
        with database_like("default", "membells", NAME=name):
            store = DatabaseLockStore("membells", {"DATABASE": "membells"})
            with store.watch(key) as waiter:
                assert not waiter.wait(0.2)
                listening = [t.name for t in threading.enumerate()]
            store.close()
            assert connections["membells"].is_in_memory_db()
            assert store.doorbells() is None
    finally:
        os.chdir(cwd)
    assert "keel-lock-listen-membells" not in listening
    assert list(tmp_path.iterdir()) == []


def test_a_release_nobody_waits_for_makes_no_bell_directory(key: str) -> None:
    assert lock(key, store="sqlite").run(lambda: None)[0]
    assert not os.path.exists(_bells("sqlite").key_dir(digest(key)))


def test_a_new_listener_sweeps_away_the_bells_of_dead_processes(key: str) -> None:
    holder = lock(key, ttl=30, store="sqlite")
    assert holder.acquire()
    with waiting_child("sqlite", key) as (killed, _):
        _until(lambda: _hung("sqlite", key), "the child's bell")
        killed.kill()
        killed.join(10)
    dead = _hung("sqlite", key)
    root = _bells("sqlite").root
    assert dead and os.path.exists(os.path.join(root, dead[0]))
    sweeper = DatabaseLockStore("sweeper", {"DATABASE": "default"})  # a listener of its own
    try:
        with sweeper.watch(f"{key}:other"):
            _until(lambda: not _hung("sqlite", key), "the dead bell swept away")
    finally:
        sweeper.close()
        holder.release()
    assert not os.path.exists(os.path.join(root, dead[0]))


@pytest.mark.django_db(transaction=True)  # writes rows in a real transaction (flushed after)
def test_a_release_inside_the_callers_transaction_rings_and_the_waiter_gets_in_at_the_commit(
    key: str,
) -> None:
    holder = lock(key, ttl=30, store="sqlite")
    assert holder.acquire()
    with waiting_child("sqlite", key) as (_, report):
        _until(lambda: _hung("sqlite", key), "the child's bell")
        time.sleep(0.3)
        with transaction.atomic():
            Invoice.objects.create()
            assert holder.release()  # joins the transaction: the others see it at the commit
            assert not report.poll(0.5), "the release was seen before the commit"
            committing_at = time.monotonic()
        assert report.poll(30), "the child never acquired"
        result = report.recv()
    assert result["acquired"] is True
    # Rung before the commit, its attempt waited for it in SQLite's busy handler (which
    # sleeps up to 100 ms at a time), not for its 5 s poll.
    assert 0 < result["at"] - committing_at < 1.0
