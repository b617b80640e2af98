"""Forking safely from a busy process: one fork lock, interrupts held, a janitor.

A forked child starts with a copy of every lock as it was at the fork, held
or not, and only the forking thread. A lock another thread held then stays
held in the child forever; the child waits on it the first time it needs it
(seen: c10's monitor mutex taken while another launch created its store,
glibc's resolver lock taken by a name lookup). So every step of a launch that
takes such locks (binding the rendezvous port, creating or destroying the
store, joining a process group in this process) runs under `guarded()`,
and so does every fork; two launches in two threads then never fork while
the other is inside one of those steps. The lock is re-entrant and is made
new in a forked child (`os.register_at_fork`), where the copy would be held.

The file descriptors only the launching process may hold (the read ends of
the workers' pipes, the rendezvous socket, the janitor's pipe) are listed in
one registry; every forked child closes them all, so a worker holds its own
pipes and nothing of another launch's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from notebook_accel.launch.channel import ChannelReader, frame
from notebook_accel.launch.processes import ChildProcess, end_processes, kill_group

# How long the launcher waits for the janitor to exit once told to.
JANITOR_EXIT_SECONDS = 5.0

_FORK_LOCK = threading.RLock()
_PARENT_ONLY: set[int] = set()


def _new_lock_in_child() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.RLock()
    _PARENT_ONLY.clear()


os.register_at_fork(after_in_child=_new_lock_in_child)


def parent_only(fd: int) -> None:
    """Have every child forked from now on close `fd` first thing."""
    with _FORK_LOCK:
        _PARENT_ONLY.add(fd)


def close_parent_only(fd: int) -> None:
    """Close `fd`, which `parent_only` listed, and forget it (exactly once)."""
    with _FORK_LOCK:
        _PARENT_ONLY.discard(fd)
        os.close(fd)


def forget_parent_only(fd: int) -> None:
    """Take `fd` off the list without closing it (its owner closes it)."""
    with _FORK_LOCK:
        _PARENT_ONLY.discard(fd)


def parent_only_fds() -> list[int]:
    """The descriptors a child forked now must close (call with the fork lock held)."""
    return sorted(_PARENT_ONLY)


class StopOnInterrupt:
    """The SIGINT handler while a launch runs: a stop press becomes a request.

    Python raises KeyboardInterrupt wherever the main thread happens to be,
    including the first line of a clean-up function, which then never runs.
    With this handler in place nothing is raised there: `request()` wakes the
    launch, which raises KeyboardInterrupt itself at one place, then tears
    down. Keep `request` free of locks: the handler runs between any two
    lines of the main thread, maybe one holding that lock.
    """

    def __init__(self, request: Callable[[], None]) -> None:
        self.pressed = False
        self._request = request

    def __call__(self, signum: int, frame: Any) -> None:
        self.pressed = True
        self._request()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a notebook's interrupt (SIGINT) until the block ends, then raise it.

    Blocking the signal with a mask is not enough: it goes to any thread that
    does not block it (a kernel has several), and Python then raises
    KeyboardInterrupt in the main thread anyway. So the handler itself is
    swapped for the block and put back after, exactly as it was. Signals only
    reach the main thread's handlers, so other threads need nothing; under a
    `StopOnInterrupt` handler nothing is raised anyway, so it stays.
    """
    if threading.current_thread() is not threading.main_thread() or isinstance(
        signal.getsignal(signal.SIGINT), StopOnInterrupt
    ):
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """While the block forks, the children's garbage collector leaves this process's
    objects alone (`gc.freeze()`, as CPython's gc documentation advises before a fork).

    A child inherits this process's uncollected garbage, and its first full
    collection would run those objects' destructors in a process where their
    runtime's threads are gone: a Ray connection that a cell or an earlier run left
    behind (a GlobalStateAccessor, whose destructor shuts down gRPC's queues) crashed
    forked FSDP workers with SIGSEGV when they collected. Frozen, what a child
    inherits is never collected there; the parent unfreezes after forking, unless
    its own code had frozen objects before (gc cannot tell ours from theirs).
    """
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Both: no other launch forks, and an interrupt waits, until the block ends."""
    with interrupts_deferred(), _FORK_LOCK:  # the lock of the moment: a child gets a new one
        yield


class Janitor:
    """A tiny process, forked before a launch's workers, that kills their process groups
    when the launch ends or the launching process dies (even by SIGKILL): nothing a
    worker started outlives the launch. Each group goes to it down a pipe; when that pipe
    closes, it kills them and exits."""

    def __init__(self) -> None:
        self.process: ChildProcess | None = None
        self._write: int | None = None

    def start(self) -> None:
        """Fork the janitor (call under `guarded()`, before the workers)."""
        read, write = os.pipe()
        try:
            pid = os.fork()
        except BaseException:
            os.close(read)
            os.close(write)
            raise
        if pid == 0:  # pragma: no cover - runs in the janitor, which exits
            _janitor_main(read)
        os.close(read)
        self.process, self._write = ChildProcess(pid), write
        parent_only(write)
        parent_only(self.process.sentinel)

    def watch(self, pgid: int) -> None:
        """Have the janitor kill group `pgid` in the end."""
        if self._write is not None:
            with contextlib.suppress(OSError):  # the janitor died: nothing to tell it
                os.write(self._write, frame([pgid]))  # one write: under PIPE_BUF, whole

    def close(self) -> None:
        """Close its pipe (it then kills the groups and exits) and reap it (once)."""
        if self._write is not None:
            write, self._write = self._write, None
            close_parent_only(write)
        process, self.process = self.process, None
        if process is not None:
            process.join(JANITOR_EXIT_SECONDS)
            end_processes([process], grace=0, groups=False)  # it did not exit: SIGKILL
            forget_parent_only(process.sentinel)
            process.close()


def _janitor_main(read: int) -> None:  # pragma: no cover - runs in the forked janitor
    """Read process groups until the pipe closes, kill them, exit. Never returns."""
    try:
        # Nothing here may close a descriptor a second time: no collection of
        # objects that own one, and every inherited descriptor but the pipe shut.
        gc.disable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop button is the launcher's
        os.setpgid(0, 0)  # a kill of the kernel's process group must leave it to clean up
        os.closerange(3, read)
        os.closerange(read + 1, os.sysconf("SC_OPEN_MAX"))
        groups: set[int] = set()
        frames = ChannelReader(rank=-1)  # the workers' link framing: lists of groups
        while data := os.read(read, 4096):  # PEP 475: a signal never cuts it short
            groups.update(frames.feed(data))
        for pgid in groups:
            kill_group(pgid, signal.SIGKILL)
    finally:
        os._exit(0)
