"""`manage.py locks run KEY -- COMMAND`: real processes on every store shared between them
(the memory store in this process): exit statuses, the fence in the child's environment, the
child stopped when the lock is lost or its supervisor killed, signals passed on."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_keel_lock import get_lock_store, lock
from django_keel_lock.conf import conf
from django_keel_lock.supervise import EXIT_HELD, EXIT_LOST
from tests.conftest import needs_store, store_params
from tests.support.commands import (
    alive,
    catches,
    child_command,
    notes_of,
    start_locks,
    wait_for,
)
from tests.support.holders import manage
from tests.support.redis_servers import FaultyProxy

SHARED_STORES = store_params(["sqlite", "postgres", "mariadb", "redis"])
PY = sys.executable


def fence_of(alias: str, key: str) -> int:
    """The fence an acquisition of `key` gets now (taken and released)."""
    handle = lock(key, store=alias, ttl=5)
    assert handle.acquire()
    assert handle.release()
    assert handle.fence is not None
    return handle.fence


@pytest.mark.parametrize("alias", SHARED_STORES)
def test_run_passes_the_fence_and_the_childs_status_and_exits_75_when_held(
    alias: str, key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    before = fence_of(alias, key)
    ran = manage("locks", "run", key, "--store", alias, "--ttl", "2", "--",
                 *child_command(notes, code=3))  # fmt: skip
    assert ran.returncode == 3, ran.stderr
    _pid, fence, seen_key = notes_of(notes)[0].split()
    assert seen_key == key
    assert before < int(fence) < fence_of(alias, key)  # this run's own acquisition
    assert get_lock_store(alias).get(key) is None  # released once the child ended

    holder = lock(key, store=alias, ttl=30, holder="elsewhere:1")
    assert holder.acquire()
    try:
        notes.unlink()
        held = manage("locks", "run", key, "--store", alias, "--", *child_command(notes))
        skipped = manage(
            "locks", "run", key, "--store", alias, "--skip-ok", "--", *child_command(notes)
        )
    finally:
        holder.release()
    assert held.returncode == EXIT_HELD, held.stderr
    assert "held elsewhere by elsewhere:1" in held.stderr
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stderr == "" and skipped.stdout == ""
    assert not notes.exists()  # neither ran the command


@pytest.mark.parametrize("alias", store_params(["postgres", "redis"]))
def test_run_stops_the_child_when_the_lock_is_lost_mid_run_and_exits_79(
    alias: str, key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    proc = start_locks("run", key, "--store", alias, "--ttl", "1.5", "--",
                       *child_command(notes, sleep=60, code=0))  # fmt: skip
    wait_for(lambda: notes_of(notes), message="the child to start")
    get_lock_store(alias).force_release(key)  # what `locks release KEY --yes` does
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_LOST, err
    assert notes_of(notes)[1:] == ["term", "exit"]  # SIGTERM'd, and it ended
    assert "lost while the command ran" in err


@needs_store("redis")
def test_a_child_deaf_to_sigterm_is_killed_after_the_grace(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    proc = start_locks("run", key, "--store", "redis", "--ttl", "1.5", "--grace", "0.5", "--",
                       *child_command(notes, sleep=60, deaf=True))  # fmt: skip
    wait_for(lambda: notes_of(notes), message="the child to start")
    pid = int(notes_of(notes)[0].split()[0])
    get_lock_store("redis").force_release(key)
    proc.communicate(timeout=20)
    assert proc.returncode == EXIT_LOST
    assert not alive(pid)
    assert notes_of(notes)[1:] == []  # it never saw SIGTERM's handler nor ended by itself


@needs_store("redis")
def test_a_store_cut_off_ends_the_child_before_another_node_can_take_the_lock(
    key: str, tmp_path: Path
) -> None:
    """The store stops answering `locks run` (but not the others): its lock expires a ttl after
    the last extend, and another node may take it then. The child (deaf to SIGTERM, and a
    --grace longer than the ttl) must be gone by then: not told only once the ttl has run out."""
    from tests.settings import REDIS_URL

    notes = tmp_path / "notes"
    proxy = FaultyProxy(int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]))
    try:
        proc = start_locks("run", key, "--store", "redis", "--ttl", "1.5", "--grace", "5", "--",
                           *child_command(notes, sleep=60, deaf=True),
                           env={"REDIS_URL": proxy.url})  # fmt: skip
        wait_for(lambda: notes_of(notes), message="the child to start")
        pid = int(notes_of(notes)[0].split()[0])
        proxy.mode = "stall"
        other = lock(key, store="redis", ttl=5, holder="other-node:1")
        wait_for(other.acquire, timeout=10, message="the lock to expire")
        running_with_it = alive(pid)
        other.release()
    finally:
        proxy.close()
    proc.communicate(timeout=20)
    assert not running_with_it, "the child still ran when another node took the lock"
    assert proc.returncode == EXIT_LOST


@needs_store("postgres")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_passed_on_and_the_lock_released_after_the_child_ends(
    signum: int, key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"
    # SIGINT is taken like SIGTERM by the child here (it has no terminal: its own group).
    program = child_command(notes, sleep=60, code=7, linger=0.5)
    program[2] = program[2].replace("signal.SIGTERM,", f"{int(signum)},")
    proc = start_locks("run", key, "--store", "postgres", "--ttl", "2", "--", *program)
    wait_for(lambda: notes_of(notes), message="the child to start")
    proc.send_signal(signum)
    wait_for(lambda: "term" in notes_of(notes), message="the child to get the signal")
    assert get_lock_store("postgres").get(key) is not None  # kept while the child ends
    proc.communicate(timeout=20)
    assert proc.returncode == 7
    assert get_lock_store("postgres").get(key) is None


@needs_store("mariadb")
def test_the_child_is_killed_when_locks_run_is_killed(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    proc = start_locks("run", key, "--store", "mariadb", "--ttl", "2", "--",
                       *child_command(notes, sleep=60))  # fmt: skip
    wait_for(lambda: notes_of(notes), message="the child to start")
    pid = int(notes_of(notes)[0].split()[0])
    proc.kill()
    proc.communicate(timeout=10)
    wait_for(lambda: not alive(pid), timeout=5, message="the orphaned child to die")


#: A command whose own child (its pid in argv[1]) ignores SIGTERM, while the command dies of it.
FAMILY = ["sh", "-c", '(trap "" TERM; exec sleep 60 >/dev/null 2>&1) & echo $! > "$0"; wait']


def grandchild(notes: Path) -> int:
    return int(wait_for(lambda: notes.read_text().strip() if notes.exists() else "",
                        message="the command's own child"))  # fmt: skip


@needs_store("redis")
def test_what_the_command_started_is_killed_when_locks_run_is_killed(
    key: str, tmp_path: Path
) -> None:
    notes = tmp_path / "pid"
    proc = start_locks("run", key, "--store", "redis", "--ttl", "2", "--", *FAMILY, str(notes))
    pid = grandchild(notes)
    proc.kill()
    proc.communicate(timeout=10)
    try:
        wait_for(lambda: not alive(pid), timeout=5, message="the command's child to die")
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@needs_store("redis")
def test_what_the_command_started_is_killed_when_the_lock_is_lost(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "pid"
    proc = start_locks("run", key, "--store", "redis", "--ttl", "2", "--grace", "0.3", "--",
                       *FAMILY, str(notes))  # fmt: skip
    pid = grandchild(notes)
    get_lock_store("redis").force_release(key)
    proc.communicate(timeout=20)
    running_on = alive(pid)
    if running_on:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == EXIT_LOST
    assert not running_on, "a process of the stopped command ran on without the lock"


def test_a_child_killed_by_a_signal_exits_128_plus_it(key: str) -> None:
    ran = manage("locks", "run", key, "--store", "sqlite", "--",
                 PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    assert ran.returncode == 128 + signal.SIGKILL, ran.stderr


def test_a_command_that_cannot_start_exits_127_and_frees_the_lock(key: str) -> None:
    ran = manage("locks", "run", key, "--store", "sqlite", "--", "/no/such/program")
    assert ran.returncode == 127
    assert "cannot run '/no/such/program'" in ran.stderr
    assert get_lock_store("sqlite").get(key) is None


def test_a_signal_while_waiting_for_the_lock_stops_the_wait(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    holder = lock(key, store="sqlite", ttl=30)
    assert holder.acquire()
    try:
        proc = start_locks(
            "run", key, "--store", "sqlite", "--wait", "30", "--", *child_command(notes)
        )
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), message="locks run to start")
        time.sleep(0.3)  # it waits in the line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        holder.release()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not notes.exists()


# -- in this process: the memory store, usage errors ---------------------------------------
def call(*args: str) -> int:
    """`locks <args>` through call_command; its exit status."""
    try:
        call_command("locks", *args, stdout=io.StringIO(), stderr=io.StringIO())
    except SystemExit as exc:
        return int(exc.code or 0)
    except CommandError as exc:
        return exc.returncode
    return 0


def test_run_on_the_memory_store_holds_the_key_in_this_process(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    assert call("run", key, "--store", "memory", "--", *child_command(notes, code=5)) == 5
    assert notes_of(notes)[0].split()[2] == key
    with lock(key, store="memory"):
        assert call("run", key, "--store", "memory", "--", *child_command(notes)) == EXIT_HELD
        assert call("run", key, "--store", "memory", "--skip-ok", "--", "true") == 0
    assert len(notes_of(notes)) == 2  # the first run's two lines only


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["run", "k", "--store", "memory"], "COMMAND must follow `--`"),
        (["run", "k", "--store", "memory", "--"], "COMMAND is missing"),
        (["run", "k", "--store", "memory", "--ttl", "0.0001", "--", "true"], "bad --ttl"),
        (["run", "k", "--store", "memory", "--ttl", "-1", "--", "true"], "bad --ttl"),
        (["run", "k", "--store", "memory", "--wait", "soon", "--", "true"], "bad --wait"),
        (["run", "k", "--store", "memory", "--grace", "-2", "--", "true"], "bad --grace"),
        (["run", "k" * 256, "--store", "sqlite", "--", "true"], "bad key"),
        (["run", "k", "--store", "nowhere", "--", "true"], "unknown store alias"),
        (["lead", "x", "--store", "memory", "--"], "COMMAND is missing"),
        (["lead", "x", "--store", "memory", "--ttl", "0", "--", "true"], "bad --ttl"),
        (["lead", "x" * 256, "--store", "sqlite", "--", "true"], "bad NAME"),
        (["list", "--store", "memory", "--", "true"], "for `run` and `lead`"),
        (["run", "k", "--store", "memory", "true"], "COMMAND must follow `--`"),
        (["run", "k", "true", "--store", "memory"], "COMMAND must follow `--`"),
        (["lead", "x", "true", "--store", "memory"], "COMMAND must follow `--`"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_argument(args: list[str], named: str) -> None:
    with pytest.raises(CommandError) as info:
        call_command("locks", *args, stdout=io.StringIO(), stderr=io.StringIO())
    assert info.value.returncode == 2
    assert named in str(info.value)


def test_usage_errors_from_the_command_line_exit_2(key: str) -> None:
    ran = manage("locks", "run", key, "--store", "sqlite", "--ttl", "0.0001", "--", "true")
    assert ran.returncode == 2
    assert "bad --ttl: ttl must be at least 0.001 seconds" in ran.stderr


def test_a_command_without_dashes_is_a_usage_error_from_the_command_line(key: str) -> None:
    ran = manage("locks", "run", key, "--store", "memory", "true")
    assert ran.returncode == 2
    assert "COMMAND must follow `--`" in ran.stderr


def test_the_command_gets_its_own_options_untouched(key: str, tmp_path: Path) -> None:
    out = tmp_path / "argv"
    code = "import sys; open(sys.argv[1], 'w').write(repr(sys.argv[2:]))"
    status = call("run", key, "--store", "memory", "--",
                  PY, "-c", code, str(out), "--ttl", "9", "--", "--store")  # fmt: skip
    assert status == 0
    assert out.read_text() == repr(["--ttl", "9", "--", "--store"])


DOWN = {"BACKEND": "django_keel_lock.stores.RedisLockStore",
        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}  # fmt: skip


def test_a_store_that_cannot_be_reached_is_exit_3_and_nothing_runs(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    with override_settings(KEEL_LOCK_STORES={**conf.STORES, "down": DOWN}):
        with pytest.raises(CommandError) as info:
            call_command("locks", "run", "k", "--store", "down", "--", *child_command(notes),
                         stdout=io.StringIO(), stderr=io.StringIO())  # fmt: skip
    assert info.value.returncode == 3
    assert "store 'down' is unavailable" in str(info.value)
    assert not notes.exists()


def test_wait_runs_the_command_once_the_holder_releases(key: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    holder = lock(key, store="sqlite", ttl=30)
    assert holder.acquire()
    proc = start_locks("run", key, "--store", "sqlite", "--wait", "20", "--",
                       *child_command(notes, code=4))  # fmt: skip
    wait_for(lambda: catches(proc.pid, signal.SIGTERM), message="locks run to start")
    time.sleep(0.3)
    assert not notes.exists()  # waiting
    holder.release()
    proc.communicate(timeout=20)
    assert proc.returncode == 4
    assert int(notes_of(notes)[0].split()[1]) > (holder.fence or 0)
