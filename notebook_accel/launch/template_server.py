"""The template process of start method "forkserver": the side that runs inside it
(launch/template.py, the kernel's side, explains the design).

It imports torch and warm.WORKER_CODE, says it is ready, then serves the kernel's
requests ("fork", "probe", "preload"); it imports what "preload" asks for one
module per turn of its loop while no worker runs, and before a fork for at most
PRELOAD_BEFORE_FORK_SECONDS. It ends with the kernel's end of the socket, ending its
workers (reaped for at most EXIT_SECONDS); if it failed, with code 1 and a traceback
on stderr, which the kernel reads back.

The messages between the two sides, sent and received here by both: one JSON object
per SOCK_SEQPACKET message, with file descriptors attached (SCM_RIGHTS).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any, NoReturn

from notebook_accel.launch.channel import WorkerPipes
from notebook_accel.launch.fresh import read_all, run_shipped
from notebook_accel.launch.processes import ChildProcess, die_with_parent, end_processes
from notebook_accel.launch.warm import (
    MAX_REASON,
    WORKER_CODE,
    choose,
    device_problem,
    import_refusing_devices,
)

# Once its socket is closed, how long the template gets to exit before SIGKILL
# (and, in the template, its workers to be reaped).
EXIT_SECONDS = 5.0
# What one message may hold: its bytes, and descriptors attached.
_MESSAGE_BYTES = 1 << 20
_MAX_FDS = 8
_RECEIVE_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
PRELOAD_BEFORE_FORK_SECONDS = 20.0


class _KernelGone(Exception):
    """The kernel closed its end of the socket, or died."""


def template_main(argv: list[str]) -> NoReturn:
    """The template process: import what workers need, then fork them on request.
    `argv`: the socket's descriptor and the kernel's pid. Never returns."""
    sock_fd, kernel_pid = int(argv[0]), int(argv[1])
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop button is the launcher's
        die_with_parent(kernel_pid)  # before the imports, which take seconds
        _Server(socket.socket(fileno=sock_fd)).run()
    except BaseException:  # noqa: BLE001 - written where the kernel reads it
        traceback.print_exc()
        code = 1
    finally:
        sys.stderr.flush()
        os._exit(code)


class _Server:
    """The template's loop: forks workers, reaps them, warms in between."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        # sentinel -> (the worker, its number at the kernel)
        self.children: dict[int, tuple[ChildProcess, int]] = {}
        self.queue: list[str] = []  # modules to import, in order
        self.failed: dict[str, str] = {}
        self.stopped: str | None = None  # why it warms and forks no more
        self.platforms: list[Any] = []
        self.threads = 0

    def run(self) -> None:
        """Import what workers need, then serve the kernel until it closes the socket."""
        import torch  # noqa: F401 - every worker imports it: forked, they have it

        import notebook_accel.launch.worker  # noqa: F401 - the workers' own code
        from notebook_accel.platforms.registry import PLATFORMS

        self.platforms = list(PLATFORMS.values())
        if problem := device_problem(self.platforms):
            self.stopped = f"importing torch started a device runtime: {problem}"
        else:
            self.threads = _thread_count()
            for name in WORKER_CODE:
                self._import(name)
        if self.stopped is not None:
            self._send({"kind": "unusable", "reason": self.stopped})
            return
        self._send({"kind": "ready", "pid": self.pid})
        with contextlib.suppress(_KernelGone):
            self._serve()
        # The kernel is gone or shut the template down: its workers go too, at once.
        end_processes([child for child, _ in self.children.values()], grace=0, reap=EXIT_SECONDS)

    def _serve(self) -> None:
        while True:
            idle = not self.children and bool(self.queue) and self.stopped is None
            ready, _, _ = select.select([self.sock, *self.children], [], [], 0 if idle else None)
            for fd in ready:
                if fd in self.children:
                    child, worker = self.children.pop(fd)
                    child.join()  # it has exited: returns at once
                    child.close()
                    self._send({"kind": "exit", "worker": worker, "code": child.exitcode})
            if self.sock in ready:
                self._take_requests()
            elif idle and not ready:
                self._import(self.queue.pop(0))

    def _take_requests(self) -> None:
        received, closed = receive(self.sock)
        for message, fds in received:
            if message["kind"] == "fork":
                self._fork(message, fds)
                continue
            close_all(fds)
            if message["kind"] == "preload":
                self._queue(message["modules"])
            elif message["kind"] == "probe":
                self._send(self._probe(message))
        if closed:
            raise _KernelGone

    def _send(self, message: dict, fds: list[int] | tuple = ()) -> None:
        try:
            send(self.sock, message, fds)
        except OSError as error:
            raise _KernelGone from error

    def _fork(self, message: dict, fds: list[int]) -> None:
        # What preload() queued first: this launch's workers start with it.
        deadline = time.monotonic() + PRELOAD_BEFORE_FORK_SECONDS
        while self.queue and self.stopped is None and time.monotonic() < deadline:
            self._import(self.queue.pop(0))
        if self.stopped is not None:
            close_all(fds)
            self._send({"kind": "refused", "id": message["id"], "reason": self.stopped})
            return
        try:
            pid = os.fork()
        except OSError as error:
            close_all(fds)
            self._send({"kind": "failed", "id": message["id"], "error": str(error)})
            return
        if pid == 0:
            self._child(message["local_rank"], fds)
        # Before the kernel hears of it: the janitor and the supervisor end its group.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        child = ChildProcess(pid)
        close_all(fds)
        self.children[child.sentinel] = (child, message["id"])
        # Its pidfd is the kernel's sentinel too.
        self._send({"kind": "forked", "id": message["id"], "pid": pid}, [child.sentinel])

    def _child(self, local_rank: int, fds: list[int]) -> NoReturn:
        """The forked worker: take the kernel's context, then run as a fresh worker does."""
        spec_fd, context_fd, *pipe_fds = fds
        pipes = WorkerPipes(*pipe_fds)
        try:
            os.setpgid(0, 0)  # a group of its own at once, as a FreshProcess
            # Errors before the worker's own redirection reach the cell too.
            os.dup2(pipes.stdout, 1)
            os.dup2(pipes.stderr, 2)
            self.sock.close()
            close_all(self.children)
            _take_kernel_context(context_fd)
            run_shipped([spec_fd, local_rank, self.pid, *pipe_fds])
        except BaseException:  # noqa: BLE001 - to the worker's stderr, which the cell shows
            traceback.print_exc()
        finally:
            os._exit(1)

    def _queue(self, modules: dict[str, str | None]) -> None:
        if self.stopped is not None:
            return
        try:
            names, skipped = choose(modules)
        except Exception as error:  # noqa: BLE001 - only the workers' speed depends on it
            names, skipped = [], dict.fromkeys(modules, f"{type(error).__name__}: {error}")
        if skipped:
            self._send({"kind": "skipped", "modules": skipped})
        self.queue += [name for name in names if name not in self.queue and name not in self.failed]

    def _import(self, name: str) -> None:
        if name in sys.modules:
            return
        before, started = len(sys.modules), time.perf_counter()
        failed = import_refusing_devices(name, self.platforms, lambda: True)
        if failed is not None:
            self.failed[name] = failed
            self._send({"kind": "skipped", "modules": {name: failed}})
            return
        seconds, imported = time.perf_counter() - started, len(sys.modules) - before
        self._send({"kind": "warmed", "module": name, "seconds": seconds, "imported": imported})
        if problem := device_problem(self.platforms):
            problem = f"started a device runtime: {problem}"
        elif _thread_count() > self.threads:
            problem = "started a thread, which forked workers would lack"
        if problem is not None:
            self.stopped = f"importing {name} {problem}"[:MAX_REASON]
            self.queue.clear()
            self._send({"kind": "stopped", "module": name, "reason": self.stopped})

    def _probe(self, message: dict) -> dict:
        import torch

        return {
            "kind": "probed",
            "id": message["id"],
            "pid": self.pid,
            "cuda_initialized": torch.cuda.is_initialized(),
            "device_problem": device_problem(self.platforms),
            "threads": _thread_count(),
            "imported": {name: name in sys.modules for name in message["modules"]},
        }


def _take_kernel_context(fd: int) -> None:
    """In a forked worker: the kernel's environment, directory, path and random state."""
    context = pickle.loads(read_all(fd))
    os.close(fd)
    os.environb.clear()
    os.environb.update(context["environ"])
    if context["cwd"] is not None:
        os.chdir(context["cwd"])
    sys.path[:] = context["path"]
    if context["rng"] is not None:
        import torch

        torch.set_rng_state(torch.frombuffer(bytearray(context["rng"]), dtype=torch.uint8))


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def send(sock: socket.socket, message: dict, fds: Iterable[int] = (), flags: int = 0) -> None:
    """One message with `fds` attached (socket.send_fds, which drops `flags` in 3.11)."""
    fds = array.array("i", fds)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else []
    sock.sendmsg([json.dumps(message).encode()], ancillary, flags)


def receive(sock: socket.socket) -> tuple[list[tuple[dict, list[int]]], bool]:
    """The messages waiting on `sock`, each with its descriptors, without waiting for
    more; and whether the other end has closed (socket.recv_fds drops the flags in 3.11)."""
    received = []
    while True:
        fds = array.array("i")
        try:
            data, ancillary, _, _ = sock.recvmsg(
                _MESSAGE_BYTES, socket.CMSG_LEN(_MAX_FDS * fds.itemsize), _RECEIVE_FLAGS
            )
        except BlockingIOError:
            return received, False
        except OSError:  # closed or reset
            return received, True
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not data:  # the other end closed
            close_all(fds)
            return received, True
        received.append((json.loads(data), list(fds)))


def close_all(fds: Iterable[int]) -> None:
    """Close every descriptor of `fds`."""
    for fd in fds:
        os.close(fd)
