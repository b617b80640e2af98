"""A group of forked worker processes: start them, watch them, stop them.

The launching process waits on one selector for everything a worker can do:
write output, send a message, or exit (its sentinel). Nothing blocks without
a deadline, and `stop()` always leaves no worker behind: SIGTERM, a short
grace period, then SIGKILL, as torch.distributed.elastic does.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import selectors
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

# Imported here, in the launching process, so that forked workers inherit
# them instead of each importing them again (milliseconds per worker).
from notebook_accel import progress as progress_module
from notebook_accel.launch import channel as channel_module
from notebook_accel.launch.errors import WorkerError, WorkerFailure
from notebook_accel.launch.observers import LineBuffer, RunObserver
from notebook_accel.nested import to_cpu

# After the first failure, how long to keep listening so that the failure that
# caused the others (often a peer's "connection closed") can be told apart.
SETTLE_SECONDS = 0.25
# SIGTERM, then this long, then SIGKILL.
TERMINATE_GRACE_SECONDS = 0.8
# After SIGKILL, how long to wait for the kernel to reap a worker.
KILL_REAP_SECONDS = 10.0

_PR_SET_PDEATHSIG = 1
# How often the launcher samples each worker's memory for live views.
RESOURCE_SAMPLE_SECONDS = 1.0
# Progress updates a worker sends at most per second (the last step always goes).
PROGRESS_UPDATES_PER_SECOND = 10


class StopSignal:
    """Lets another thread (a Stop button) end a run: `set()` wakes the launcher."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._set = False
        self._closed = False
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            if not self._set and not self._closed:
                self._set = True
                os.write(self._write, b"x")

    def is_set(self) -> bool:
        return self._set

    def fileno(self) -> int:
        return self._read

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


@dataclass
class WorkerSpec:
    """Everything a worker needs, fixed before the first fork."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    node_rank: int
    local_world_size: int
    environment: dict[str, str]
    threads_per_process: int
    return_all: bool
    # Calls the function in the worker: (function, args, kwargs, local_rank,
    # local_world_size) -> value. The XLA backend runs it as a PJRT process.
    run: Callable[..., Any]
    worker_environment: Callable[[int], dict[str, str]] = field(default=lambda local_rank: {})

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_world_size + local_rank


@dataclass
class _Worker:
    rank: int
    local_rank: int
    process: multiprocessing.process.BaseProcess
    buffers: dict[int, LineBuffer] = field(default_factory=dict)
    reader: channel_module.ChannelReader = field(default_factory=channel_module.ChannelReader)
    error: dict | None = None
    exitcode: int | None = None
    noticed_at: float = 0.0


class WorkerGroup:
    """The workers of one launch attempt on this node."""

    def __init__(
        self,
        spec: WorkerSpec,
        observer: RunObserver,
        stop: StopSignal | None = None,
        close_in_workers: list[int] = (),
    ):
        self.spec = spec
        self.observer = observer
        self.stop_signal = stop
        self.close_in_workers = list(close_in_workers)
        self.workers: list[_Worker] = []
        self.results: dict[int, Any] = {}
        self._selector = selectors.DefaultSelector()
        self._next_sample = 0.0
        if stop is not None:
            self._selector.register(stop.fileno(), selectors.EVENT_READ)
        self._streams: dict[int, tuple[_Worker, str]] = {}
        self._sentinels: dict[int, _Worker] = {}
        self._stopped = False

    # -- starting --------------------------------------------------------------

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        # An interrupt between a fork and the bookkeeping would leave a worker
        # that stop() does not know about: it waits until every worker is known.
        with _interrupts_deferred():
            for local_rank in range(self.spec.local_world_size):
                self._start_one(context, local_rank)

    def _start_one(self, context: Any, local_rank: int) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        chan_r, chan_w = os.pipe()
        # The child must not hold the read ends of any pipe, or the pipes of the
        # workers started before it.
        inherited = [out_r, err_r, chan_r, *self._streams, *self.close_in_workers]
        process = context.Process(
            target=_worker_main,
            args=(self.spec, local_rank, out_w, err_w, chan_w, inherited, os.getpid()),
            name=f"notebook_accel-worker-{local_rank}",
            daemon=False,
        )
        try:
            process.start()
        except BaseException:
            for fd in (out_r, err_r, chan_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, chan_w):
                os.close(fd)
        worker = _Worker(self.spec.global_rank(local_rank), local_rank, process)
        worker.buffers = {out_r: LineBuffer(), err_r: LineBuffer()}
        self.workers.append(worker)
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr"), (chan_r, "channel")):
            os.set_blocking(fd, False)
            self._streams[fd] = (worker, stream)
            self._selector.register(fd, selectors.EVENT_READ)
        self._sentinels[process.sentinel] = worker
        self._selector.register(process.sentinel, selectors.EVENT_READ)

    # -- watching --------------------------------------------------------------

    def wait(self, deadline: float | None) -> None:
        """Return when every worker has exited cleanly; raise WorkerError or TimeoutError."""
        first_failure_at: float | None = None
        while True:
            if first_failure_at is not None:
                if time.monotonic() - first_failure_at >= SETTLE_SECONDS:
                    break
                timeout = first_failure_at + SETTLE_SECONDS - time.monotonic()
            elif all(worker.exitcode is not None for worker in self.workers):
                break
            elif deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise TimeoutError
            else:
                timeout = None
            if self.stop_signal is not None and self.stop_signal.is_set():
                raise KeyboardInterrupt("the run was stopped")
            until_sample = max(0.0, self._next_sample - time.monotonic())
            timeout = until_sample if timeout is None else min(max(timeout, 0.0), until_sample)
            for key, _ in self._selector.select(timeout):
                self._handle(key.fd)
            if time.monotonic() >= self._next_sample:
                self._sample_resources()
            if first_failure_at is None and self._failed_workers():
                first_failure_at = time.monotonic()
        failures = self._failed_workers()
        if failures:
            raise WorkerError(self._failures_cause_first(failures))

    def _sample_resources(self) -> None:
        self._next_sample = time.monotonic() + RESOURCE_SAMPLE_SECONDS
        for worker in self.workers:
            if worker.exitcode is not None:
                continue
            try:
                rss = psutil.Process(worker.process.pid).memory_info().rss
            except psutil.Error:
                continue
            self.observer.on_message(worker.rank, "resources", {"rss_bytes": rss})

    def _handle(self, fd: int) -> None:
        # An fd may have been closed earlier in the same batch of events.
        if fd in self._sentinels:
            self._selector.unregister(fd)
            self._on_exit(self._sentinels.pop(fd))
        elif fd in self._streams:
            worker, stream = self._streams[fd]
            self._read(worker, fd, stream)

    def _read(self, worker: _Worker, fd: int, stream: str) -> None:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:  # every writer is gone
                self._selector.unregister(fd)
                del self._streams[fd]
                os.close(fd)
                if stream != "channel":
                    self._emit_lines(worker, stream, worker.buffers[fd].flush())
                return
            if stream == "channel":
                for kind, payload in worker.reader.feed(data):
                    self._on_message(worker, kind, payload)
            else:
                self._emit_lines(worker, stream, worker.buffers[fd].feed(data))

    def _emit_lines(self, worker: _Worker, stream: str, lines: list[str]) -> None:
        for line in lines:
            self.observer.on_output(worker.rank, stream, line)

    def _on_message(self, worker: _Worker, kind: str, payload: Any) -> None:
        if kind == "result":
            self.results[worker.rank] = payload
        elif kind == "error":
            worker.error = payload
        elif kind == "unreadable":  # the worker runs on, but its message is lost: stop
            worker.error = {
                "exception": "UnpicklingError: the launching process could not read what the "
                f"worker sent back ({payload}); return plain data (tensors, numbers, strings)",
                "traceback": "",
                "time": time.time(),
            }
        else:
            self.observer.on_message(worker.rank, kind, payload)

    def _on_exit(self, worker: _Worker) -> None:
        worker.process.join(timeout=1.0)
        worker.exitcode = worker.process.exitcode
        worker.noticed_at = time.time()
        # What the worker wrote before exiting is already in the pipes.
        for fd, (owner, stream) in list(self._streams.items()):
            if owner is worker:
                self._read(worker, fd, stream)
        self.observer.on_worker_exit(worker.rank, worker.exitcode)

    def _failed_workers(self) -> list[_Worker]:
        return [w for w in self.workers if w.error is not None or (w.exitcode or 0) != 0]

    @staticmethod
    def _failures_cause_first(workers: list[_Worker]) -> list[WorkerFailure]:
        # A worker that died without raising (a signal, os._exit) cannot be a
        # casualty of a peer's Python exception; among the ones that raised, the
        # earliest raised first and the rest saw its connection close.
        def order(worker: _Worker) -> tuple[int, float]:
            if worker.error is None:
                return (0, worker.noticed_at)
            return (1, worker.error["time"])

        failures = []
        for worker in sorted(workers, key=order):
            error = worker.error or {}
            failures.append(
                WorkerFailure(
                    rank=worker.rank,
                    exitcode=worker.exitcode,
                    traceback=error.get("traceback", ""),
                    exception=error.get("exception", ""),
                )
            )
        return failures

    # -- stopping --------------------------------------------------------------

    def stop(self) -> None:
        """Terminate every worker still running and release every resource (once)."""
        if self._stopped:
            return
        self._stopped = True
        with _interrupts_deferred():
            self._terminate()

    def _terminate(self) -> None:
        alive = [w for w in self.workers if w.process.exitcode is None]
        descendants = _descendants([w.process.pid for w in alive])
        for worker in alive:
            _signal(worker.process.pid, signal.SIGTERM)
        _wait_for_exit(alive, TERMINATE_GRACE_SECONDS)
        for worker in alive:
            if worker.process.exitcode is None:
                _signal(worker.process.pid, signal.SIGKILL)
        # SIGKILL always ends a process, but one freeing a GPU context can take a
        # while; wait for it (bounded) so that no child is left unreaped.
        _wait_for_exit(alive, KILL_REAP_SECONDS)
        for process in descendants:
            try:
                process.kill()
            except psutil.Error:
                pass
        for worker in self.workers:
            if worker.exitcode is None:
                worker.exitcode = worker.process.exitcode
            for fd, (owner, stream) in list(self._streams.items()):
                if owner is worker:
                    self._read(worker, fd, stream)
                    if stream != "channel":  # a last line without a newline
                        self._emit_lines(worker, stream, worker.buffers[fd].flush())
            if worker.process.exitcode is not None:
                worker.process.close()
        for fd in list(self._streams):
            os.close(fd)
        self._streams.clear()
        self._selector.close()


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold a notebook's interrupt (SIGINT) until the block ends, then raise it.

    Blocking the signal with a mask is not enough: it goes to any thread that
    does not block it (a kernel has several), and Python then raises
    KeyboardInterrupt in the main thread anyway. So the handler itself is
    swapped for the block and put back after, exactly as it was. Signals only
    reach the main thread's handlers, so other threads need nothing.
    """
    if threading.current_thread() is not threading.main_thread():
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


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait_for_exit(workers: list[_Worker], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for worker in workers:
        remaining = max(0.0, deadline - time.monotonic())
        worker.process.join(timeout=remaining)


def _descendants(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found += psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            pass
    return found


# -- inside the worker ---------------------------------------------------------


def _worker_main(
    spec: WorkerSpec,
    local_rank: int,
    stdout_fd: int,
    stderr_fd: int,
    channel_fd: int,
    inherited_fds: list[int],
    parent_pid: int,
) -> None:
    """The first code a forked worker runs. Never returns: it exits the process."""
    # The launcher owns interrupts: a notebook's stop button signals the whole
    # process group, and the launcher then stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    for fd in inherited_fds:
        os.close(fd)
    _redirect_output(stdout_fd, stderr_fd)
    rank = spec.global_rank(local_rank)
    os.environ.update(spec.environment)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(spec.node_rank),
            "NODE_RANK": str(spec.node_rank),
        }
    )
    os.environ.update(spec.worker_environment(local_rank))

    import torch

    # The kernel may have started OpenMP's thread pool before the fork; in the
    # child that pool is gone but libgomp still thinks it exists, and the first
    # parallel op with more than one thread waits on it forever.
    torch.set_num_threads(spec.threads_per_process)

    channel = channel_module.ChannelWriter(channel_fd)
    channel_module.set_worker_channel(channel)
    _send_progress_through(channel)
    exitcode = 0
    try:
        value = spec.run(spec.function, spec.args, spec.kwargs, local_rank, spec.local_world_size)
        _send_peak_resources(channel)
        if rank == spec.global_rank(0) or spec.return_all:
            _send_result(channel, value)
        _barrier_before_exit()
    except SystemExit as stop:
        exitcode = _exit_status(stop.code)
        if exitcode:
            _send_error(channel, stop)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the kernel
        _send_peak_resources(channel)
        _send_error(channel, error)
        exitcode = 1
    finally:
        try:
            channel.flush()  # metrics still waiting for their batch
        except OSError:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(exitcode)


def _send_progress_through(channel: channel_module.ChannelWriter) -> None:
    """Route the main process's progress bar to the launcher, at most 10 updates/s."""
    last_sent = [0.0]

    def send(step: int, total: int | None, elapsed: float) -> None:
        now = time.monotonic()
        final = total is not None and step >= total
        if final or step == 0 or now - last_sent[0] >= 1 / PROGRESS_UPDATES_PER_SECOND:
            last_sent[0] = now
            channel.send("progress", {"step": step, "total": total, "elapsed": elapsed})

    progress_module.set_progress_hook(send)


def _send_peak_resources(channel: channel_module.ChannelWriter) -> None:
    import resource

    import torch

    peaks = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_initialized():
        peaks["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    try:
        channel.send("resources", peaks)
    except OSError:  # the launcher is already gone; nothing to report to
        pass


def _send_result(channel: channel_module.ChannelWriter, value: Any) -> None:
    try:
        channel.send("result", to_cpu(value))
    except Exception as error:  # noqa: BLE001
        raise TypeError(
            f"the training function returned a {type(value).__name__} that cannot be sent "
            f"back to the notebook ({error}); return tensors, numbers, strings, or "
            "containers of them"
        ) from error


def _send_error(channel: channel_module.ChannelWriter, error: BaseException) -> None:
    channel.send(
        "error",
        {
            "exception": f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
            "traceback": _user_traceback(error),
            "time": time.time(),
        },
    )


def _user_traceback(error: BaseException) -> str:
    """The traceback from the user's function down, without the launcher's frames."""
    tb = error.__traceback__
    launch_dir = os.path.dirname(__file__)
    while (
        tb is not None
        and tb.tb_next is not None
        and (os.path.dirname(tb.tb_frame.f_code.co_filename) == launch_dir)
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _barrier_before_exit() -> None:
    """Let every rank finish its last collective before any of them exits.

    Exiting tears down the sockets; a peer still reading the last message of a
    collective would see "connection reset" instead of its data.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this worker if the launching process dies (kernel restart)."""
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "prctl") else None
    except OSError:  # not Linux
        return None


_LIBC = _load_libc()


def _redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Point fd 1 and 2 at the launcher's pipes and rebuild sys.stdout/stderr.

    In a notebook, sys.stdout is the kernel's own stream object, which a forked
    child must not use; logging handlers made earlier may still point at it.
    """
    old_streams = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    sys.stdout = _text_stream(1)
    sys.stderr = _text_stream(2)
    faulthandler.enable(file=sys.stderr)
    for handler in _all_stream_handlers():
        which = old_streams.get(id(handler.stream))
        if which is not None:
            # Assign rather than setStream(): that would flush the kernel's stream.
            handler.stream = getattr(sys, which)


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
    )


def _all_stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    return [
        handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler)
    ]
