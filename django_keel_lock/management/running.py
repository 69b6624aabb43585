"""`manage.py locks run` and `locks lead`: a command run under a lock, or kept on one node.

    manage.py locks run KEY [--ttl T] [--wait T] [--grace T] [--store A] [--skip-ok] -- COMMAND...
    manage.py locks lead NAME [--ttl T] [--grace T] [--store A] -- COMMAND...

`run` takes KEY (waiting up to --wait, default 0), runs COMMAND with the lock's fence in its
environment (KEEL_LOCK_FENCE, and KEEL_LOCK_KEY), keeps the lock alive while it runs, and
releases it when it ends. `lead` campaigns for leadership of the election NAME
(`django_keel_lock.election`) as long as it takes, runs COMMAND while it leads (the term in
KEEL_LOCK_FENCE), and campaigns again when leadership is lost.

Exit status: the command's (killed by signal N: 128 + N); 75 (EX_TEMPFAIL) when `run` found
the lock held elsewhere, 0 then with --skip-ok; 79 when the lock was lost while the command
ran, or the store stopped answering (`run`; the command was stopped: SIGTERM, then SIGKILL
after --grace, and never after the lock's confirmed expiry: `supervise.Deadline`); 2 for
usage errors, a command not after `--` included;
3 when the store could not be reached before the command started; 126/127 when the command
could not be started. SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are passed on to the
command, and the lock is released once it has ended; a signal while waiting for the lock
stops the wait (exit 128 + N; `lead`: 0).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ..core import Lock, lock
from ..durations import to_seconds
from ..exceptions import LockStoreUnavailable, LockUnavailable
from ..leaders import Election, election
from ..options import printable, ttl_seconds
from ..stores.base import LockStore
from ..supervise import (
    EXIT_CANNOT_RUN,
    EXIT_HELD,
    EXIT_NOT_FOUND,
    Deadline,
    Interrupted,
    Supervisor,
)

EXIT_USAGE = 2
#: How long a lost command gets between SIGTERM and SIGKILL, unless --grace says.
DEFAULT_GRACE = 5.0
#: A candidate whose store failed asks again after this long.
CAMPAIGN_RETRY = 1.0


def add_arguments(add: Any) -> None:
    """The `run` and `lead` subcommands, on the `locks` command's `add(name, help)`."""
    run = add("run", "Run a command while holding a lock (exit 75 when it is held elsewhere).")
    run.add_argument("key", metavar="KEY")
    run.add_argument("--wait", default="0", metavar="T", help="how long to wait for the lock")
    run.add_argument(
        "--skip-ok", action="store_true", help="exit 0, not 75, when it is held elsewhere"
    )
    lead = add("lead", "Keep a command running on exactly one node: the election's leader.")
    lead.add_argument("name", metavar="NAME")
    for sub in (run, lead):
        sub.add_argument(
            "--ttl", metavar="T", help="lock ttl: how long a dead holder blocks the key"
        )
        sub.add_argument(
            "--grace",
            default=str(DEFAULT_GRACE),
            metavar="T",
            help=f"SIGTERM to SIGKILL when the lock is lost (default {DEFAULT_GRACE:g}s)",
        )
        sub.add_argument("command", nargs="*", metavar="-- COMMAND [ARGS]")


def split_command(args: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """argv split at its first `--`: what the `locks` parser reads, and the command after it
    (None: no `--`). argparse alone would read the command's own options as ours."""
    args = list(args)
    if "--" not in args:
        return args, None
    at = args.index("--")
    return args[:at], args[at + 1 :]


def usage(message: str) -> CommandError:
    return CommandError(message, returncode=EXIT_USAGE)


def _duration(option: str, value: str, *, allow_zero: bool = False) -> float:
    try:
        return to_seconds(option, value, allow_zero=allow_zero)
    except (TypeError, ValueError) as exc:
        raise usage(f"bad {option}: {exc}") from exc


def _ttl(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return ttl_seconds(value)
    except (TypeError, ValueError) as exc:
        raise usage(f"bad --ttl: {exc}") from exc


def _command(options: dict[str, Any]) -> list[str]:
    command: list[str] = options.get("command") or []
    if not command or not command[0]:
        action = options["action"]
        raise usage(
            f"COMMAND is missing: manage.py locks {action} {'KEY' if action == 'run' else 'NAME'}"
            " [options] -- COMMAND [ARGS...]"
        )
    return command


def _env(key: str, fence: int) -> dict[str, str]:
    return {**os.environ, "KEEL_LOCK_FENCE": str(fence), "KEEL_LOCK_KEY": key}


def _start(
    supervisor: Supervisor, command: list[str], env: dict[str, str], deadline: Deadline
) -> int:
    """Run `command` under `supervisor`; a command that cannot be started: 126/127."""
    try:
        return supervisor.run(command, env, deadline)
    except FileNotFoundError as exc:
        sys.stderr.write(f"locks: cannot run {command[0]!r}: {exc.strerror}\n")
        return EXIT_NOT_FOUND
    except OSError as exc:
        sys.stderr.write(f"locks: cannot run {command[0]!r}: {exc.strerror or exc}\n")
        return EXIT_CANNOT_RUN


def _release(handle: Lock) -> None:
    try:
        handle.release()
    except LockStoreUnavailable as exc:  # it expires within its ttl
        sys.stderr.write(f"locks: could not release {handle.key!r} ({exc}); it expires\n")


def _resign(leader: Election) -> None:
    try:
        leader.resign()
    except LockStoreUnavailable as exc:  # leadership ends with its ttl
        sys.stderr.write(f"locks: could not resign {leader.name!r} ({exc}); it expires\n")


def do_run(store: LockStore, key: str, options: dict[str, Any]) -> int:
    """`locks run`: the exit status (the caller exits with it)."""
    command = _command(options)
    wait = _duration("--wait", options["wait"], allow_zero=True)
    grace = _duration("--grace", options["grace"], allow_zero=True)
    supervisor = Supervisor(grace)
    handle = lock(
        key,
        ttl=_ttl(options["ttl"]),
        store=store.alias,
        auto_extend=True,
        on_lost=lambda lost: supervisor.lost("the lock was lost while the command ran"),
    )
    supervisor.install()
    try:
        try:
            supervisor.waiting(True)
            acquired = handle.acquire(timeout=wait)
        except Interrupted as signalled:
            return 128 + signalled.signum
        finally:
            supervisor.waiting(False)
        if not acquired:
            return _held_elsewhere(handle, options)
        try:
            if supervisor.signalled is not None:  # stopped between the lock and the start
                return 128 + supervisor.signalled
            assert handle.fence is not None
            deadline = Deadline.of_lock(handle.confirmed_until, handle.ttl, grace)
            status = _start(supervisor, command, _env(key, handle.fence), deadline)
        finally:
            _release(handle)
    finally:
        supervisor.uninstall()
    if supervisor.stopped:
        sys.stderr.write(f"locks: {key!r}: {supervisor.lost_reason}; the command was stopped\n")
    return status


def _held_elsewhere(handle: Lock, options: dict[str, Any]) -> int:
    if options["skip_ok"]:
        return 0
    try:
        info = handle.info()
    except LockStoreUnavailable:
        info = None
    by = "" if info is None else f" by {printable(info.holder)} (fence {info.fence})"
    sys.stderr.write(f"locks: {handle.key!r} is held elsewhere{by}; not run\n")
    return EXIT_HELD


def do_lead(store: LockStore, name: str, options: dict[str, Any]) -> int:
    """`locks lead`: campaign, run the command while leading, campaign again when leadership
    is lost; the command's exit status once it ends by itself (or was passed a signal)."""
    command = _command(options)
    grace = _duration("--grace", options["grace"], allow_zero=True)
    supervisor = Supervisor(grace)
    try:
        leader = election(
            name,
            ttl=_ttl(options["ttl"]),
            store=store.alias,
            on_lost=lambda term: supervisor.lost(f"leadership (term {term}) was lost"),
        )
    except ValueError as exc:
        raise usage(f"bad NAME: {exc}") from exc
    supervisor.install()
    try:
        while True:
            term = _campaign(leader, supervisor)
            if term is None:
                return 0
            deadline = Deadline.of_lock(leader.confirmed_until, leader.ttl, grace)
            try:
                status = _start(supervisor, command, _env(leader.key, term), deadline)
            finally:
                _resign(leader)
            if not supervisor.stopped or supervisor.signalled is not None:
                return status
            sys.stderr.write(f"locks: {name!r}: {supervisor.lost_reason}; campaigning again\n")
    finally:
        supervisor.uninstall()


def _campaign(leader: Election, supervisor: Supervisor) -> int | None:
    """The term once this node leads; None when a signal stopped the candidate."""
    supervisor.reset()
    while True:
        supervisor.waiting(True)
        try:
            return leader.campaign()
        except Interrupted:
            return None
        except LockUnavailable:  # not raised without a timeout; were it, ask again
            continue
        except LockStoreUnavailable as exc:
            sys.stderr.write(f"locks: store unavailable while campaigning ({exc}); retrying\n")
            time.sleep(CAMPAIGN_RETRY)
        finally:
            supervisor.waiting(False)


def check_command_split(parser: CommandParser) -> None:
    """Make `parser` read its argv up to the first `--`, the rest being the command."""
    parse = parser.parse_args

    def parse_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        head, command = split_command(sys.argv[2:] if args is None else args)
        if command is None and _runs_a_command(head):
            # Without `--` argparse would take the command's options for ours, and its words
            # for COMMAND or not depending on where our options stand.
            what = "KEY" if head[0] == "run" else "NAME"
            fail(f"COMMAND must follow `--`: manage.py locks {head[0]} {what} [options] -- COMMAND")
        parsed = parse(head, namespace)
        if command is not None:
            if parsed.action not in ("run", "lead"):
                fail(f"'--' and a command are for `run` and `lead`, not {parsed.action}")
            parsed.command = [*getattr(parsed, "command", []), *command]
        return parsed

    def fail(message: str) -> None:
        if getattr(parser, "called_from_command_line", False):
            parser.error(message)  # exit 2, with the usage
        raise usage(message)  # call_command: exit 2 too, not CommandParser's 1

    parser.parse_args = parse_args  # type: ignore[method-assign, assignment]


def _runs_a_command(head: Sequence[str]) -> bool:
    """Whether argv (before any `--`) is `run` or `lead`, not asking for help."""
    return bool(head) and head[0] in ("run", "lead") and not {"-h", "--help"} & set(head)
