"""SQLite's doorbells cannot be turned against the host: a release and a new waiter's sweep
remove dead bells, so nothing they remove may be chosen by another local user (issue 29)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from django_keel_lock import get_lock_store, lock
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.database.doorbells import SUN_PATH_MAX, Doorbells, digest

from .conftest import needs
from .test_database_faults import wait_until
from .test_sqlite_wakeups import sqlite_store

NOBODY = 65534  # "another user": the tests run as root, who may give a directory away
AS_ROOT = needs(os.geteuid() == 0, "root, to give a directory to another user (os.chown)")
PRECIOUS = "keep me"


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A temporary directory whose path leaves room for a bell's socket path beside a database
    file in it (tmp_path's may not)."""
    path = tempfile.mkdtemp(prefix="kb-")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, True)


@pytest.fixture
def bells(short_tmp_path: Path) -> Iterator[Doorbells]:
    """The doorbells of a new SQLite lock store, alias "bells" (nothing made on disk yet)."""
    with sqlite_store(short_tmp_path / "db" / "locks.sqlite3", "bells") as alias:
        found = get_lock_store(alias).doorbells()  # type: ignore[attr-defined]
        assert found is not None
        yield found


def _victims(tmp_path: Path) -> list[Path]:
    """Files another user would like the app to delete: one named as a bell is, in a
    directory of ours that only we may write into (as a bell's is)."""
    directory = tmp_path / "victims"
    directory.mkdir(mode=0o700)
    victims = [directory / "precious.txt", directory / "4242-0badf00d"]
    for victim in victims:
        victim.write_text(PRECIOUS)
    return victims


def _plant_links(directory: Path, victims: list[Path]) -> list[Path]:
    """Links named as bells in `directory` (made if missing), to `victims`, as a bell's are."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    links = [directory / f"{4000 + n}-deadbeef" for n in range(len(victims))]
    for link, victim in zip(links, victims, strict=True):
        link.symlink_to(victim)
    return links


def _intact(victims: list[Path]) -> bool:
    return all(victim.read_text() == PRECIOUS for victim in victims)


@contextmanager
def waiting(key: str) -> Iterator[DatabaseLockStore]:
    """Wait for `key` (so bind a bell) on a store of its own, a listener of its own, on the
    database of the store "bells"."""
    store = DatabaseLockStore("bells-listener", {"DATABASE": "bells"})
    try:
        with store.watch(key):
            yield store
    finally:
        store.close()


def _bell_of(bells: Doorbells, key: str) -> str:
    """The path of the one bell hung for `key`, once it is."""
    links = bells.key_dir(digest(key))
    assert wait_until(lambda: os.path.isdir(links) and os.listdir(links), 30), "no bell hung"
    return os.readlink(os.path.join(links, os.listdir(links)[0]))


def test_a_release_never_removes_the_file_a_planted_bell_link_points_to(
    bells: Doorbells, key: str, tmp_path: Path
) -> None:
    Path(bells.root).mkdir(mode=0o700)
    victims = _victims(tmp_path)
    links = _plant_links(Path(bells.key_dir(digest(key))), victims)
    assert lock(key, store="bells").run(lambda: None)[0]  # its release rings the key's bells
    assert _intact(victims)
    assert not any(os.path.lexists(link) for link in links)  # dead bells: links taken down


def test_a_new_waiters_sweep_never_removes_the_file_a_planted_bell_link_points_to(
    bells: Doorbells, key: str, tmp_path: Path
) -> None:
    Path(bells.root).mkdir(mode=0o700)
    victims = _victims(tmp_path)
    links = _plant_links(Path(bells.key_dir(digest(f"{key}:nobody releases"))), victims)
    links += _plant_links(Path(bells.root), victims)  # where the sockets are swept too
    with waiting(key):
        _bell_of(bells, key)  # the sweep ran before the bell was hung
    assert _intact(victims)
    assert not any(os.path.lexists(link) for link in links[:2])  # dead bells: links taken down


def _acquired_by_a_waiter(key: str) -> bool:
    """Hold `key`, release it while a thread waits for it (polling every 50 ms): whether
    the thread then got it."""
    holder = lock(key, ttl=30, store="bells")
    assert holder.acquire()
    acquired: list[bool] = []

    def wait() -> None:
        waiter = lock(key, ttl=30, store="bells")
        acquired.append(waiter.acquire(timeout=30, retry_delay=0.05))
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    assert holder.release()
    thread.join(40)
    return acquired == [True]


def _give_away(root: Path, links: Path, victims: list[Path]) -> None:
    root.mkdir(mode=0o700)
    _plant_links(root / links.name, victims)
    os.chown(root, NOBODY, NOBODY)


def _open_to_all(root: Path, links: Path, victims: list[Path]) -> None:
    root.mkdir()
    _plant_links(root / links.name, victims)
    root.chmod(0o777)


def _symlink_elsewhere(root: Path, links: Path, victims: list[Path]) -> None:
    elsewhere = root.parent.parent / "elsewhere"
    _plant_links(elsewhere / links.name, victims)
    root.symlink_to(elsewhere)


@pytest.mark.parametrize(
    "made",
    [pytest.param(_give_away, marks=AS_ROOT), _open_to_all, _symlink_elsewhere],
    ids=["another-users", "mode-0777", "a-symlink"],
)
def test_a_bell_directory_that_is_not_ours_alone_is_not_used_and_locks_still_work(
    made: Callable[[Path, Path, list[Path]], None],
    bells: Doorbells,
    key: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, victims = Path(bells.root), _victims(tmp_path)
    made(root, Path(bells.key_dir(digest(key))), victims)  # links to them for `key`
    before = sorted(os.listdir(root))
    with caplog.at_level(logging.WARNING, "django_keel_lock"), waiting(f"{key}:w") as store:
        assert wait_until(lambda: not store.push_possible, 30), "the bells were used"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(bells.root in message and "remove it" in message for message in warned), warned
    assert sorted(os.listdir(root)) == before  # no bell bound, none hung
    assert _acquired_by_a_waiter(key)  # its release rings (not) the directory it refuses
    assert _intact(victims)


@pytest.mark.parametrize("long_path", [False, True], ids=["beside-the-file", "temp-dir"])
def test_the_bell_directories_made_are_0700_and_the_bells_0600(
    long_path: bool, key: str, short_tmp_path: Path
) -> None:
    database = short_tmp_path / ("d" * SUN_PATH_MAX if long_path else "db") / "locks.sqlite3"
    with sqlite_store(database, "bells") as alias:
        bells = get_lock_store(alias).doorbells()  # type: ignore[attr-defined]
        bell = ""
        try:
            with waiting(key):
                bell = _bell_of(bells, key)
                modes = {
                    path: stat.S_IMODE(os.lstat(path).st_mode)
                    for path in (bells.root, bells.key_dir(digest(key)), os.path.dirname(bell))
                }
                socket_mode = stat.S_IMODE(os.lstat(bell).st_mode)
        finally:
            if long_path and bell:  # outside short_tmp_path
                shutil.rmtree(os.path.dirname(bell), True)
    assert modes == dict.fromkeys(modes, 0o700)
    assert socket_mode == 0o600
    assert os.path.dirname(bell) == (bells.root if not long_path else bells.socket_dir())


@AS_ROOT
def test_a_temp_dir_for_bells_that_another_user_made_first_is_not_used(
    key: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database = tmp_path / ("d" * SUN_PATH_MAX) / "locks.sqlite3"
    with sqlite_store(database, "bells") as alias:
        bells = get_lock_store(alias).doorbells()  # type: ignore[attr-defined]
        with waiting(key):  # where would our bells go?
            bell = _bell_of(bells, key)
        sockets = os.path.dirname(bell)
        try:  # its listener takes it down as it ends, maybe after close() gave up waiting
            assert wait_until(lambda: not os.path.lexists(bell), 30), "the bell stayed"
            os.chown(sockets, NOBODY, NOBODY)  # made first by another user
            with caplog.at_level(logging.WARNING, "django_keel_lock"), waiting(key) as store:
                assert wait_until(lambda: not store.push_possible, 30), "the bells were used"
            assert os.listdir(sockets) == []
            assert not os.path.exists(bells.key_dir(digest(key)))
        finally:
            shutil.rmtree(sockets, True)
    assert any(sockets in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_bell_directory_of_ours_that_others_may_only_read_is_made_0700_and_used(
    bells: Doorbells, key: str
) -> None:
    root = Path(bells.root)
    root.mkdir()
    root.chmod(0o755)  # as the doorbells made it before they made it private
    with waiting(key) as store:
        assert os.path.dirname(_bell_of(bells, key)) == bells.root
        assert store.push_possible
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
