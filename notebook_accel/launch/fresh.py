"""Workers started in fresh interpreters, for a kernel that can no longer fork them.

A forked worker inherits the kernel's CUDA (or XLA) runtime, which does not
survive a fork: once a cell has touched a GPU, forked workers cannot use
theirs. A fresh interpreter starts clean, at the price of importing torch
again (about 1.5 s). The worker runs exactly the code a forked one runs
(launch/worker.py); only how it gets there differs:

- The kernel starts `python -c <bootstrap>` with `subprocess` (an exec, so
  nothing of the kernel's runtime or locks comes along) and passes it the
  write ends of its pipes by number.
- The function and its arguments travel by value (launch/packing.py), pickled
  once per launch into an in-memory file that every worker reads.

Start method "forkserver" (launch/template.py) forks the workers from one such
interpreter, started once; they run the same code from `run_shipped` on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from typing import Any, NoReturn

import cloudpickle

from notebook_accel.launch.channel import WorkerPipes, write_all
from notebook_accel.launch.packing import pack
from notebook_accel.launch.processes import PidfdProcess, bootstrap, start_interpreter

_BOOTSTRAP = bootstrap(__name__, "run_shipped")


def ship(spec: Any) -> int:
    """Pickle a WorkerSpec for fresh interpreters into an in-memory file; return its fd.
    The user's function and arguments go by value inside it (`spec.shipped`), unpacked
    by each worker once its environment is set: GPU tensors land on that worker's device."""
    shipped = pack(spec.function, spec.args, spec.kwargs)
    outer = dataclasses.replace(spec, function=None, args=(), kwargs={}, shipped=shipped)
    return in_memory_file("notebook_accel-worker-spec", cloudpickle.dumps(outer, protocol=5))


def in_memory_file(name: str, data: bytes) -> int:
    """A new in-memory file (memfd) holding `data`; return its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        raise
    return fd


class FreshProcess(PidfdProcess):
    """One worker in a new interpreter (a `processes.ProcessHandle`)."""

    def __init__(self, spec_fd: int, local_rank: int, pipes: WorkerPipes, name: str) -> None:
        self.name = name
        self._spec_fd, self._local_rank, self._pipes = spec_fd, local_rank, pipes
        self._popen: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the interpreter; only the listed descriptors go with it."""
        fds = self._pipes.fds()
        self._popen = start_interpreter(
            _BOOTSTRAP,
            self._spec_fd,
            self._local_rank,
            os.getpid(),
            *fds,
            # Errors before the worker's own redirection (a failed import) reach the cell too.
            stdout=self._pipes.stdout,
            stderr=self._pipes.stderr,
            pass_fds=(self._spec_fd, *fds),
        )
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)


def run_shipped(argv: list[int] | list[str]) -> NoReturn:
    """Run a worker: `argv` holds the descriptor of the spec `ship` wrote (closed once
    read), its local rank, the process it dies with (this interpreter's starter, or the
    template that forked it), and the descriptors of its WorkerPipes."""
    spec_fd, local_rank, parent_pid, *pipes = map(int, argv)
    blob = read_all(spec_fd)
    os.close(spec_fd)
    from notebook_accel.launch.worker import worker_main

    worker_main(cloudpickle.loads(blob), local_rank, WorkerPipes(*pipes), [], parent_pid)


def read_all(fd: int) -> bytes:
    """The whole content of the in-memory file `fd`, read from its start."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 24, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
