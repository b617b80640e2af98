"""The processes the launcher starts, behind one handle, and how they are ended.

However a process is started (forked by multiprocessing, a fresh interpreter, a
fork of the template, a bare `os.fork`, or a process that is nobody's child, as
the keeper of a detached run), the launcher sees a `ProcessHandle`: start, pid,
sentinel, exit code, join, kill, close. `end_processes` ends any of them the
same way: SIGTERM, a grace period, SIGKILL, a bounded wait, as
torch.distributed.elastic's process contexts do.

Written here once: the bootstrap a fresh interpreter runs (`bootstrap`,
`interpreter_argv`), the parent-death signal (`die_with_parent`), and the start
of a process that outlives its starter (`start_detached`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import multiprocessing.context
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO, Any, Protocol

import psutil

# SIGTERM, then this long, then SIGKILL.
TERMINATE_GRACE_SECONDS = 0.8
# After SIGKILL, how long to wait for a process to be reaped.
KILL_REAP_SECONDS = 10.0

# Runs in a new interpreter: the starting process's import path first, then the function.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from {module} import {function}; {function}(sys.argv[2:])"
)
_PR_SET_PDEATHSIG = 1


class ProcessHandle(Protocol):
    """What the launcher needs of a process it starts, however it is started.

    `sentinel` is a descriptor that becomes readable when the process exits;
    `exitcode` is None while it runs, else its exit status (minus the signal's
    number if a signal ended it), as `multiprocessing.Process` has them.
    """

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def start(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self, signum: int = signal.SIGKILL) -> None: ...

    def close(self) -> None: ...


def bootstrap(module: str, function: str) -> str:
    """The code a new interpreter runs (`python -c`): this process's sys.path, then
    `module.function(argv)` with the arguments `interpreter_argv` gave it."""
    return _BOOTSTRAP.format(module=module, function=function)


def interpreter_argv(code: str, *args: object) -> list[str]:
    """The command line of a new interpreter that runs `code` (see `bootstrap`)."""
    return [sys.executable, "-c", code, json.dumps(sys.path), *map(str, args)]


def die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this process when its parent dies (PR_SET_PDEATHSIG); exit at
    once if it has died already (before the signal was set)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "prctl") else None
    except OSError:  # not Linux
        return None


_LIBC = _load_libc()


def kill_group(pgid: int, signum: int) -> None:
    """Signal every process of group `pgid`; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def send_signal(pidfd: int, signum: int) -> None:
    """Signal the process behind `pidfd` (no pid-reuse race); one gone is fine."""
    if pidfd >= 0:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signum)


# -- ending ----------------------------------------------------------------------------


def end_processes(
    processes: Iterable[ProcessHandle],
    grace: float = TERMINATE_GRACE_SECONDS,
    reap: float = KILL_REAP_SECONDS,
    groups: bool = True,
) -> None:
    """SIGTERM, `grace` seconds, SIGKILL to those left, and at most `reap` seconds for
    them to exit; with `grace` 0, SIGKILL at once. With `groups`, the first signal
    also goes to the process group each leads (what it started may clean up too)."""
    processes = [process for process in processes if process.exitcode is None]
    first = signal.SIGTERM if grace > 0 else signal.SIGKILL
    for process in processes:
        if groups and process.pid is not None:
            kill_group(process.pid, first)
        process.kill(first)  # also in case it does not lead its group yet
    if grace > 0:
        wait_for_exit(processes, grace)
        for process in processes:
            if process.exitcode is None:
                process.kill(signal.SIGKILL)
    # SIGKILL always ends a process, but one freeing a GPU context can take a while:
    # wait for it (bounded) so that no child is left unreaped.
    wait_for_exit(processes, reap)


def wait_for_exit(processes: list[ProcessHandle], seconds: float) -> None:
    """Wait at most `seconds` in all for every one of `processes` to exit."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


# -- the handles -----------------------------------------------------------------------


class ForkedProcess(multiprocessing.context.ForkProcess):
    """A worker forked by multiprocessing; `kill` takes the signal to send."""

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to it while it runs."""
        if self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class ChildProcess:
    """A child this process forked itself (`os.fork()`), watched through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # Opened before anything could reap it: surely this child's.
        self.sentinel = os.pidfd_open(pid)
        self._exitcode: int | None = None

    def start(self) -> None:
        """It runs already: `os.fork()` started it."""

    @property
    def exitcode(self) -> int | None:
        """Its exit status once it has exited (reaping it), else None."""
        if self._exitcode is None and self._readable(0):
            self._reap()
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds for it to exit, woken by its exit."""
        if self._exitcode is None and self._readable(timeout):
            self._reap()

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to it while it runs."""
        if self._exitcode is None:
            send_signal(self.sentinel, signum)

    def close(self) -> None:
        """Release the pidfd; once."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def _readable(self, timeout: float | None) -> bool:
        if self.sentinel < 0:
            return False
        return bool(select.select([self.sentinel], [], [], timeout)[0])

    def _reap(self) -> None:
        try:
            _, status = os.waitpid(self.pid, 0)  # it has exited: returns at once
            self._exitcode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by someone else: its status is lost
            self._exitcode = -signal.SIGKILL


class OtherProcess:
    """A process this one did not start as its child (a detached keeper, a leftover),
    known by its pid and its start time (so a reused pid is never signalled)."""

    def __init__(self, process: psutil.Process) -> None:
        self._process = process
        self.pid = process.pid
        self.sentinel = -1
        self._exitcode: int | None = None

    @classmethod
    def of(cls, pids: Iterable[int]) -> list[OtherProcess]:
        """Handles on those of `pids` that run now."""
        found = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                found.append(cls(psutil.Process(pid)))
        return found

    def start(self) -> None:
        """It runs already."""

    @property
    def exitcode(self) -> int | None:
        """0 once it has exited (its status is its parent's to read), else None."""
        self.join(0)
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds for it to exit."""
        if self._exitcode is None:
            with contextlib.suppress(psutil.TimeoutExpired):
                code = self._process.wait(timeout)
                self._exitcode = code if isinstance(code, int) else 0

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to it while it runs."""
        with contextlib.suppress(psutil.Error):
            self._process.send_signal(signum)

    def close(self) -> None:
        """Nothing to release."""


def start_detached(target: str, args: list[str], stderr: IO[bytes], seconds: float) -> int | None:
    """Start `target` ("module:function", called with `*args` and the stop signals that
    came while it imported) in a new interpreter and session, as nobody's child: the
    interpreter forks it and exits. Its stdout and stderr go to `stderr`. Returns its
    pid (`OtherProcess.of` watches it); None when it did not start within `seconds`."""
    first = subprocess.Popen(
        interpreter_argv(bootstrap(__name__, "_detach"), target, *args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
        close_fds=True,
        cwd=os.getcwd(),
    )
    try:
        said, _ = first.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        first.kill()
        first.wait()
        said = b""
    pid = said.strip()
    return int(pid) if first.returncode == 0 and pid.isdigit() else None


def _detach(argv: list[str]) -> Any:  # pragma: no cover - runs in the new interpreter
    # A stop that comes while the target imports (seconds) is kept for when it can act on it.
    stops: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.dup2(2, 1)  # its output goes where its errors go; the starter's pipe closes
    module, _, function = argv[0].partition(":")
    return getattr(importlib.import_module(module), function)(*argv[1:], stops)
