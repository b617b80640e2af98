"""The processes the launcher starts, behind one handle, and how they are ended.

However a process is started (forked by multiprocessing, a fresh interpreter, a
fork of the template, a bare `os.fork`), the launcher holds a `ProcessHandle`,
and `end_processes` ends any of them alike: SIGTERM, a grace period, SIGKILL, a
bounded wait, as torch.distributed.elastic's process contexts do. Also the
bootstrap of a fresh interpreter, and the start of a process that is nobody's child.
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
from collections.abc import Callable, Iterable
from typing import IO, Any, Protocol

import psutil

# SIGTERM, then this long, then SIGKILL.
TERMINATE_GRACE_SECONDS = 0.8
# After SIGKILL, how long to wait for a process to be reaped.
KILL_REAP_SECONDS = 10.0

_PR_SET_PDEATHSIG = 1


class ProcessHandle(Protocol):
    """What the launcher needs of a process it started, as `multiprocessing.Process`
    has it: `sentinel` becomes readable when it exits; `exitcode` is None while it
    runs, else its exit status (minus the signal's number if a signal ended it)."""

    pid: int | None
    sentinel: int
    exitcode: int | None

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self, signum: int = signal.SIGKILL) -> None: ...
    def close(self) -> None: ...


def bootstrap(module: str, function: str) -> str:
    """The code a new interpreter runs: the starting process's sys.path, then
    `module.function(args)` with the arguments `start_interpreter` gave it."""
    return (
        "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
        f"from {module} import {function}; {function}(sys.argv[2:])"
    )


def start_interpreter(code: str, *args: object, **popen: Any) -> subprocess.Popen:
    """A new interpreter that runs `code` (see `bootstrap`), its stdin closed, holding
    no descriptor but `pass_fds`, in a process group of its own unless it starts a
    session: the kernel's stop button (SIGINT to the kernel's group) is the launcher's."""
    if "start_new_session" not in popen and sys.version_info >= (3, 11):
        popen["process_group"] = 0
    argv = [sys.executable, "-c", code, json.dumps(sys.path), *map(str, args)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True, **popen)


def die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this process when its parent dies (PR_SET_PDEATHSIG); exit at
    once if the parent died already."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def kill_group(pgid: int, signum: int) -> None:
    """Signal every process of group `pgid`; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def end_processes(
    processes: Iterable[ProcessHandle],
    grace: float = TERMINATE_GRACE_SECONDS,
    reap: float = KILL_REAP_SECONDS,
    groups: bool = True,
) -> None:
    """SIGTERM, `grace` seconds, SIGKILL to those left (with `grace` 0: SIGKILL at
    once), then at most `reap` seconds for them to exit. With `groups`, the first
    signal goes to the group each leads too: what it started may clean up as well."""
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
    # SIGKILL always ends a process, but one freeing a GPU context can take a while.
    wait_for_exit(processes, reap)


def wait_for_exit(processes: list[ProcessHandle], seconds: float) -> None:
    """Wait at most `seconds` in all for every one of `processes` to exit."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


class ForkedProcess(multiprocessing.context.ForkProcess):
    """A worker forked by multiprocessing; `kill` takes the signal to send."""

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class PidfdProcess:
    """A process watched through a pidfd, its `sentinel`, which also signals it free of
    pid reuse. A subclass says what `exitcode` is."""

    pid: int | None = None
    sentinel = -1
    exitcode: int | None

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.sentinel >= 0 and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, signum)

    def close(self) -> None:
        """Release the pidfd (after it has exited); once."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class ChildProcess(PidfdProcess):
    """A child this process forked itself (`os.fork()`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # before anything could reap it: surely this child
        self.exitcode: int | None = None

    def start(self) -> None:
        """It runs already."""

    def join(self, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds for it to exit, and reap it."""
        if self.exitcode is None and select.select([self.sentinel], [], [], timeout)[0]:
            try:
                _, status = os.waitpid(self.pid, 0)  # it has exited: returns at once
                self.exitcode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.exitcode = -signal.SIGKILL


class OtherProcess:
    """A process that is not this one's child (a keeper, a leftover): known by its pid
    and start time, so that a reused pid is never signalled."""

    def __init__(self, process: psutil.Process) -> None:
        self._process = process
        self.pid, self.sentinel = process.pid, -1
        self._exited = False

    @classmethod
    def of(cls, pids: Iterable[int]) -> list[OtherProcess]:
        """Handles on those of `pids` that run now."""
        return [cls(process) for process in of_each(pids, lambda process: [process])]

    @property
    def exitcode(self) -> int | None:
        """0 once it has exited (its status is its parent's to read), else None."""
        self.join(0)
        return 0 if self._exited else None

    def start(self) -> None:
        """It runs already."""

    def join(self, timeout: float | None = None) -> None:
        if not self._exited:
            with contextlib.suppress(psutil.TimeoutExpired):
                self._process.wait(timeout)
                self._exited = True

    def kill(self, signum: int = signal.SIGKILL) -> None:
        with contextlib.suppress(psutil.Error):
            self._process.send_signal(signum)

    def close(self) -> None:
        """Nothing to release."""


def of_each(pids: Iterable[int], get: Callable[[psutil.Process], list[Any]]) -> list[Any]:
    """`get(process)` of each of the processes `pids` that is still there, concatenated."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found += get(psutil.Process(pid))
    return found


def start_detached(target: str, args: list[str], log: IO[bytes], seconds: float) -> int | None:
    """Start `target` ("module:function", called with `*args` and the stop signals that
    came while it imported) in a new session, as nobody's child: a new interpreter
    forks it and exits. Its output goes to `log`. Its pid; None if it did not start
    within `seconds` (`log` says why)."""
    first = start_interpreter(
        bootstrap(__name__, "_detach"),
        target,
        *args,
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
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


def _detach(argv: list[str]) -> None:  # pragma: no cover - runs in the new interpreter
    # A stop that comes while the target imports (seconds) is kept for when it can act on it.
    stops: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
    if pid := os.fork():
        print(pid, flush=True)
        os._exit(0)
    os.dup2(2, 1)  # its output goes to the log; the starter's pipe closes
    module, _, function = argv[0].partition(":")
    getattr(importlib.import_module(module), function)(*argv[1:], stops)
