"""Workers started in fresh interpreters, for a kernel that can no longer fork them.

A forked worker inherits the kernel's CUDA (or XLA) runtime, which does not
survive a fork: once a cell has touched a GPU, forked workers cannot use
theirs. A fresh interpreter starts clean, at the price of importing torch
again (about 1.5 s). The worker runs exactly the code a forked one runs
(launch/worker.py); only how it gets there differs:

- The kernel starts `python -c <bootstrap>` with `subprocess` (an exec, so
  nothing of the kernel's runtime or locks comes along) and passes it the
  write ends of its pipes by number.
- The function and its arguments travel by value through cloudpickle, so a
  function, class or closure defined in a notebook cell works as it does in
  a forked worker. They are pickled once per launch into an in-memory file
  that every worker reads.
- A tensor on a GPU in the arguments (a model the kernel loaded and
  evaluated) arrives on the GPU of each worker that runs on CUDA, and on the
  CPU in a CPU worker: never on whichever GPU the kernel used.

`FreshProcess` has the part of `multiprocessing.Process` the supervisor uses
(pid, sentinel, exitcode, join, close), so both start methods share one
supervisor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import linecache
import marshal
import os
import pickle
import subprocess
import sys
import types
from typing import Any

import cloudpickle

from notebook_accel.config import ENV_BACKEND

# The names `start_method` takes; "auto" forks unless the kernel can no longer.
START_METHODS = ("auto", "fork", "spawn")
# Set to "fork" or "spawn" to change what start_method=None means (tests run the
# launcher's suite under both this way).
ENV_START_METHOD = "NOTEBOOK_ACCEL_START_METHOD"

# Runs in the new interpreter: the kernel's import path first, then the worker.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from notebook_accel.launch.fresh import child_main; child_main(sys.argv[2:])"
)


def resolve_start_method(asked: str | None) -> str:
    """`asked`, or for None $NOTEBOOK_ACCEL_START_METHOD, else "auto"."""
    if asked is not None:
        return asked
    value = os.environ.get(ENV_START_METHOD) or "auto"
    if value not in START_METHODS:
        raise ValueError(
            f"${ENV_START_METHOD}={value!r} must be one of {', '.join(START_METHODS)}; "
            "unset it for the default."
        )
    return value


# -- the kernel's side ------------------------------------------------------------------


def ship(spec: Any) -> int:
    """Pickle a WorkerSpec for fresh interpreters into an in-memory file; return its fd.

    The user's function and arguments are pickled by value, inside the spec
    (`spec.shipped`), and unpacked by each worker after its environment is
    set, so GPU tensors land on the device that worker uses.
    """
    shipped = pack(spec.function, spec.args, spec.kwargs)
    outer = dataclasses.replace(spec, function=None, args=(), kwargs={}, shipped=shipped)
    blob = cloudpickle.dumps(outer, protocol=5)
    fd = os.memfd_create("notebook_accel-worker-spec", os.MFD_CLOEXEC)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def pack(function: Any, args: tuple, kwargs: dict) -> bytes:
    """A function and its arguments, pickled by value for a worker (`unpack` there)."""
    buffer = io.BytesIO()
    pickler = _WorkerPickler(buffer, protocol=5)
    pickler.dump((function, args, kwargs))
    # The source of code that exists only in this process (a notebook cell), so
    # that a worker's traceback shows the cell's lines as a forked one's does.
    sources = {
        name: linecache.getlines(name)
        for name in sorted(pickler.code_files)
        if not os.path.exists(name) and linecache.getlines(name)
    }
    return pickle.dumps((buffer.getvalue(), sources), protocol=5)


class _WorkerPickler(cloudpickle.Pickler):
    """cloudpickle, with two changes for workers:

    - Code keeps its file name and line numbers (marshalled whole; the worker
      runs the same interpreter), where cloudpickle would name it
      "<dynamic-code>": tracebacks then point at the notebook cell.
    - Tensors on a GPU go as CPU copies that each worker moves to its own
      device (plain pickling would restore them onto the GPU index the kernel
      used, which a worker may not have).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.code_files: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            self.code_files.add(obj.co_filename)
            return marshal.loads, (marshal.dumps(obj),)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            is_parameter = isinstance(obj, torch.nn.Parameter)
            return _on_worker_device, (obj.detach().cpu(), is_parameter, obj.requires_grad)
        return super().reducer_override(obj)


def _on_worker_device(tensor: Any, is_parameter: bool, requires_grad: bool) -> Any:
    """Runs in the worker: put a tensor that was on a GPU in the kernel on this worker's device."""
    import torch

    if os.environ.get(ENV_BACKEND) == "cuda":
        tensor = tensor.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


class FreshProcess:
    """One worker in a new interpreter, watched as a `multiprocessing.Process` is."""

    def __init__(
        self,
        spec_fd: int,
        local_rank: int,
        stdout_fd: int,
        stderr_fd: int,
        channel_fd: int,
        command_fd: int | None,
        name: str,
    ) -> None:
        self.name = name
        fds = (spec_fd, local_rank, stdout_fd, stderr_fd, channel_fd, os.getpid(), command_fd)
        self._argv = [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), *map(str, fds)]
        self._fds = tuple(
            fd for fd in (spec_fd, stdout_fd, stderr_fd, channel_fd, command_fd) if fd is not None
        )
        self._stdout, self._stderr = stdout_fd, stderr_fd
        self._popen: subprocess.Popen | None = None
        self.sentinel = -1

    def start(self) -> None:
        """Start the interpreter; only the listed descriptors go with it."""
        # A group of its own from the start: the kernel's stop button (SIGINT to
        # the kernel's group) leaves it to the launcher, as with forked workers.
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
        self._popen = subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            # Errors before the worker's own redirection (a failed import) reach the cell too.
            stdout=self._stdout,
            stderr=self._stderr,
            pass_fds=self._fds,
            close_fds=True,
            **group,
        )
        self.sentinel = os.pidfd_open(self._popen.pid)

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status once it has exited (minus the signal's number if killed)."""
        return None if self._popen is None else self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds for it to exit."""
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)

    def close(self) -> None:
        """Release the sentinel (after it has exited)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


# -- the new interpreter's side ---------------------------------------------------------


def child_main(argv: list[str]) -> None:
    """Read the spec the kernel shipped, then run as any worker does (never returns)."""
    spec_fd, local_rank, stdout_fd, stderr_fd, channel_fd, parent_pid = map(int, argv[:6])
    command_fd = None if argv[6] == "None" else int(argv[6])
    blob = _read_all(spec_fd)
    os.close(spec_fd)
    from notebook_accel.launch.worker import worker_main

    spec = cloudpickle.loads(blob)
    worker_main(spec, local_rank, stdout_fd, stderr_fd, channel_fd, [], parent_pid, command_fd)


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 24, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def unpack(shipped: bytes) -> tuple[Any, tuple, dict]:
    """The user's function, args and kwargs, in the worker.

    What the function's cell defined (classes, helpers) is also put in this
    interpreter's `__main__`, as it is in the kernel's: a value of a class
    from the notebook is then sent back by reference and arrives in the
    kernel as an instance of the kernel's own class.
    """
    payload, sources = pickle.loads(shipped)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    function, args, kwargs = cloudpickle.loads(payload)
    names = getattr(function, "__globals__", None)
    if isinstance(names, dict) and names.get("__name__") == "__main__":
        main = sys.modules["__main__"].__dict__
        for name, value in names.items():
            if not name.startswith("__"):
                main.setdefault(name, value)
    return function, args, kwargs
