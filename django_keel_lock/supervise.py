"""Run a command as a child process while a lock is held, and stop it when the lock is lost.

`manage.py locks run` and `locks lead` use it; it knows nothing of stores or Django. A
`Supervisor` starts the child, passes on the signals this process gets, and waits for the
first of: the child exits, `lost()` is called (from the lock's watchdog thread), or the
lock's `Deadline` comes near with no renewal confirmed. Then the child is sent SIGTERM, and
SIGKILL after `grace` seconds, or sooner: at the deadline, the moment another node may take
the lock. So a store that stops answering stops the child *before* its lock can expire, not
once it has (when a new holder's child may already run); only a lock found gone early (taken
over, force-released, a paused process waking) overlaps, and fences cover that.

On Linux the child is also killed (SIGKILL) when this process dies without a word (`kill -9`,
the OOM killer): `PR_SET_PDEATHSIG`, set between fork and exec. The kernel sends it when the
*thread* that forked the child ends, so a supervisor is meant to start its child from a
thread that outlives it (the main thread, as `run` does: it returns only once the child has
been reaped). That covers the child only, not what it started (`sh -c 'a; b'` runs b as its
own child): when the child has a process group of its own, a guard (`GUARD`, a shell reading
a pipe only this process can write) kills the whole group once that pipe closes without a
word, which it does when this process dies, on every POSIX system.

Process groups: without a terminal the child runs in a process group of its own, and each
signal passed on goes to that whole group (a `sh -c` and what it started). On a terminal the
child stays in ours, so it can read the terminal; Ctrl-C and Ctrl-\\ then reach it from the
terminal itself, and are not sent a second time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import NamedTuple

#: The exit status when the lock was held elsewhere (`EX_TEMPFAIL` in sysexits.h, what
#: `flock -E 75` and cron wrappers use for "try again later").
EXIT_HELD = 75
#: The exit status when the lock was lost while the command ran and the command was stopped.
#: Outside sysexits.h's 64-78 and below the 126-165 a shell gives, so it means only this.
EXIT_LOST = 79
#: A command that could not be started: not executable (126), not found (127), as a shell says.
EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127

#: Signals passed on to the child. With a terminal, the ones it sends to its whole foreground
#: group (and so to the child already) are taken but not sent again.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
FROM_TERMINAL = frozenset({signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})

PR_SET_PDEATHSIG = 1

#: The guard of a child's process group ($1): told "done" when the child ended under
#: supervision; end of input without it (this process died) kills the group. Deaf to the
#: signals a terminal or a service manager sends a whole group, so it outlives us.
GUARD = 'trap "" INT TERM HUP QUIT; read -r done || kill -s KILL -- "-$1"'


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _death_signal() -> Callable[[], None] | None:
    """What the child runs between fork and exec: die with its parent (Linux), else None.

    libc is loaded here, in the parent: the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call: nobody supervises
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_parent


class Deadline(NamedTuple):
    """When the lock a command runs under may be taken by another node: `until()` (monotonic,
    read each time: renewals push it out). The command is sent SIGTERM `notice` seconds
    before it when no renewal came, and SIGKILL at it."""

    until: Callable[[], float]
    notice: float

    @classmethod
    def of_lock(cls, confirmed_until: Callable[[], float], ttl: float, grace: float) -> Deadline:
        """The deadline of a lock with `ttl` whose last confirmed expiry `confirmed_until()`
        gives; renewed every ttl / 3, so at most ttl / 3 of notice, or every renewal would
        stop the command. SIGKILL lands a little before the expiry (a tenth of the ttl, at
        most 100 ms), the time for the kernel to end the command."""
        margin = min(0.1, ttl / 10)
        return cls(lambda: confirmed_until() - margin, min(grace, ttl / 3))


class Interrupted(BaseException):
    """A signal passed on to a command that has not started: stop waiting for the lock."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Supervisor:
    """Runs one command; thread-safe `lost()`; `run()` from the main thread to pass signals on.

    Use: `supervisor.waiting()` around the wait for the lock (a signal then raises
    `Interrupted`), then `supervisor.run(argv, env)`, which returns the exit status."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.proc: subprocess.Popen[bytes] | None = None
        self.signalled: int | None = None  # the last signal passed on (or taken before start)
        self.lost_reason: str | None = None
        #: The last `run` stopped its command because the lock was lost.
        self.stopped = False
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._own_group = not _on_terminal()
        self._wait_interrupts = False
        self._previous: dict[int, object] = {}

    def reset(self) -> None:
        """Forget the last command and any loss reported for it: before the next lock."""
        self._events, self.lost_reason, self.stopped = queue.SimpleQueue(), None, False

    # -- the lock's side ---------------------------------------------------------------
    def lost(self, reason: str) -> None:
        """The lock is gone: stop the child (callable from any thread)."""
        if self.lost_reason is None:
            self.lost_reason = reason
        self._events.put("lost")

    # -- signals -------------------------------------------------------------------------
    def install(self) -> None:
        """Take the forwarded signals (main thread only; elsewhere nothing is passed on)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in FORWARDED:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def waiting(self, on: bool) -> None:
        """While on, a signal raises `Interrupted` (the wait for the lock is abandoned)."""
        self._wait_interrupts = on

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum
        if self._wait_interrupts:
            raise Interrupted(signum)
        if self.proc is not None and not (signum in FROM_TERMINAL and not self._own_group):
            self._send(signum)

    def _send(self, signum: int) -> None:
        assert self.proc is not None
        if self.proc.returncode is not None:  # reaped: its pid may be another process's now
            return
        try:
            if self._own_group:
                os.killpg(self.proc.pid, signum)
            else:
                os.kill(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # it ended meanwhile (a zombie we have not reaped)

    # -- the child -----------------------------------------------------------------------
    def run(
        self, argv: Sequence[str], env: Mapping[str, str], deadline: Deadline | None = None
    ) -> int:
        """Start `argv` and supervise it; its exit status, or EXIT_LOST when the lock was lost
        or its `deadline` came near unrenewed (the child stopped). Raises OSError when it
        cannot be started. A supervisor runs one command at a time, and may run another after
        it (`reset()` first)."""
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            preexec_fn=_death_signal(),
            process_group=0 if self._own_group else None,
        )
        guard = self._guard(self.proc.pid)
        try:
            return self._supervise(deadline)
        finally:  # not reaped (an exception): nobody supervises it now, the guard kills it
            _dismiss(guard, ended=self.proc.returncode is not None)

    def _supervise(self, deadline: Deadline | None) -> int:
        assert self.proc is not None
        threading.Thread(target=self._watch_exit, name="keel-lock-child", daemon=True).start()
        if self.signalled is not None and self.signalled not in FROM_TERMINAL:
            self._send(self.signalled)  # it came between the lock and the start
        if self._next(deadline) == "exit":
            return exit_status(self.proc.wait())
        self.lost("no renewal was confirmed before the lock's ttl was nearly over")
        self._stop(deadline)
        self.stopped = True
        return EXIT_LOST

    def _guard(self, group: int) -> subprocess.Popen[bytes] | None:
        """Start the guard of the child's process group (none when it has none)."""
        if not self._own_group:
            return None
        try:
            return subprocess.Popen(
                ["/bin/sh", "-c", GUARD, "keel-lock-guard", str(group)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                process_group=0,
            )
        except OSError:  # no /bin/sh: the child alone dies with us (Linux)
            return None

    def _watch_exit(self) -> None:
        """Wait for the child to end without reaping it, so its pid (and group) stays ours
        until the main thread reaps it: no signal can reach a process that took its pid."""
        assert self.proc is not None
        try:
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        self._events.put("exit")

    def _stop(self, deadline: Deadline | None) -> None:
        """SIGTERM the child, SIGKILL it after the grace (at the deadline if sooner), reap it.

        SIGKILL goes to its group even when the child ended within the grace, before it is
        reaped (the group's id is still ours then): what it started must not run on without
        the lock."""
        self._send(signal.SIGTERM)
        grace = self.grace
        if deadline is not None:
            grace = max(0.0, min(grace, deadline.until() - time.monotonic()))
        self._exited(grace)
        self._send(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()

    def _exited(self, timeout: float) -> bool:
        """Wait up to `timeout` for the child to end (not reaped: `_watch_exit` says)."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                if self._events.get(timeout=min(left, 1.0)) == "exit":
                    return True
            except queue.Empty:
                continue
        return False

    def _next(self, deadline: Deadline | None) -> str:
        """The first of "exit", "lost", and "expiring" (the deadline's notice has come).

        Bounded waits in a loop: signal handlers run between the waits whatever the
        platform's queue does with an interrupted wait, and renewals move the deadline."""
        while True:
            wait = 1.0
            if deadline is not None:
                wait = min(wait, deadline.until() - deadline.notice - time.monotonic())
                if wait <= 0:
                    return "expiring"
            try:
                return self._events.get(timeout=wait)
            except queue.Empty:
                continue


def _dismiss(guard: subprocess.Popen[bytes] | None, ended: bool) -> None:
    """Tell the guard whether the child `ended` under supervision (else it kills the
    child's group), and reap it."""
    if guard is None:
        return
    assert guard.stdin is not None
    try:
        guard.stdin.write(b"done\n" if ended else b"")
        guard.stdin.close()
    except OSError:  # it is gone already
        pass
    guard.wait()


def _on_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):
        return False
