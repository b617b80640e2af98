"""The child's runtime: the first and last code a forked worker runs.

`worker_main` points the worker's output at the supervisor's pipes, arranges
to die with the launching process, sends its metrics and progress down its
channel, calls the training function, sends back the result or the error,
and exits. The launching process's side is launch/supervisor.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import inspect
import itertools
import logging
import os
import resource
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn

from notebook_accel.config.settings import ENV_BACKEND
from notebook_accel.launch import debugging
from notebook_accel.launch.channel import ChannelWriter, WorkerPipes
from notebook_accel.launch.output_pipes import python_streams
from notebook_accel.launch.processes import die_with_parent
from notebook_accel.launch.stacks import StackRequests
from notebook_accel.launch.warm import imported_since
from notebook_accel.platforms.registry import platform_named

# Imported here, in the launching process, so that forked workers inherit
# them instead of each importing them again (milliseconds per worker): the
# training function logs through metrics and draws progress through progress.
from notebook_accel.reporting.destination import Destination, sending_to
from notebook_accel.reporting.events import (
    CheckpointSaved,
    ModulesImported,
    PeakResources,
    Progress,
    Result,
    WorkerRaised,
)
from notebook_accel.training import ddp_teardown
from notebook_accel.training.nested import to_cpu

# Progress updates a worker sends at most per second (the last step always goes).
PROGRESS_UPDATES_PER_SECOND = 10


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
    # Send the modules the worker imported itself, at milestones and at the end
    # (launch/warm.py).
    report_imports: bool = False
    # "fork", or "spawn" (a fresh interpreter, launch/fresh.py) or "forkserver"
    # (forked from a template process, launch/template.py), which get the
    # function and its arguments pickled by value in `shipped` instead.
    start_method: str = "fork"
    shipped: bytes | None = None
    # The global rank of local rank 0 where nodes run different numbers of workers
    # (a cluster's); by default node_rank * local_world_size.
    first_rank: int | None = None
    # Start from an empty `__main__` (a worker forked from a cluster's agent).
    own_main: bool = False
    # The rank whose value comes back without return_all: by default this node's
    # first (each machine's launcher returns its own); on a cluster, rank 0.
    main_rank: int | None = None
    # A worker whose function raises opens pdb on its frames, prompting in the
    # cell, before it ends (launch/debugging.py).
    post_mortem: bool = False

    def unpacked(self) -> WorkerSpec:
        """This spec with the shipped function and arguments unpickled (in the worker)."""
        if self.shipped is None:
            return self
        from notebook_accel.launch.packing import unpack

        try:
            function, args, kwargs = unpack(self.shipped)
        except Exception as error:
            raise RuntimeError(
                "this worker, started in a fresh interpreter, could not load the function or "
                f"its arguments ({type(error).__name__}: {error}). Whatever they refer to must "
                "be importable here too: define it in the notebook, or install its module"
            ) from error
        return dataclasses.replace(self, function=function, args=args, kwargs=kwargs, shipped=None)

    def returns_value(self, rank: int) -> bool:
        """Whether worker `rank` sends its value back."""
        main = self.global_rank(0) if self.main_rank is None else self.main_rank
        return self.return_all or rank == main

    def global_rank(self, local_rank: int) -> int:
        if self.first_rank is None:
            return self.node_rank * self.local_world_size + local_rank
        return self.first_rank + local_rank


def worker_main(
    spec: WorkerSpec,
    local_rank: int,
    pipes: WorkerPipes,
    inherited_fds: list[int],
    parent_pid: int,
) -> NoReturn:
    """The first code a worker runs, on the worker's ends of `pipes`. Never returns: it
    exits the process."""
    global _CHANNEL
    modules_at_fork = len(sys.modules)
    # The launcher owns interrupts: a notebook's stop button signals the whole
    # process group, and the launcher then stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A child keeps the forking thread's signal mask: a cluster's agent forks from one
    # of Ray's threads, which block SIGINT and SIGTERM. The launcher's signals must land.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # The launcher ends a worker with SIGTERM: a handler the forking process has must
    # not run here (Ray's, in a kernel that started a Ray cluster, stops that cluster).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Lead a process group of its own: whatever this worker starts stays in it,
    # and the launcher (or its janitor) ends the group with the launch.
    os.setpgid(0, 0)
    die_with_parent(parent_pid)  # a kernel restart ends it
    for fd in inherited_fds:
        os.close(fd)
    _redirect_output(pipes)
    # Every thread's stack to stderr on the launcher's request, and a note down the
    # channel once there is one (launch/stacks.py says why and how).
    stack_requests = StackRequests(sys.stderr)
    rank, node = spec.global_rank(local_rank), str(spec.node_rank)
    os.environ.update(spec.environment)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), GROUP_RANK=node, NODE_RANK=node)
    os.environ.update(spec.worker_environment(local_rank))
    if spec.own_main:
        # The notebook's names (and a live worker's namespace) get a module of their own
        # rather than the forking process's program (a cluster agent's is Ray's), which
        # stays referenced: its objects' destructors must not run in this process.
        global _FORKING_PROCESS_MAIN
        _FORKING_PROCESS_MAIN = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")

    import torch

    # The kernel may have started OpenMP's thread pool before the fork; in the
    # child that pool is gone but libgomp still thinks it exists, and the first
    # parallel op with more than one thread waits on it forever.
    torch.set_num_threads(spec.threads_per_process)

    _CHANNEL = channel = ChannelWriter(pipes.channel)
    debugging.install(channel, rank)  # input() and breakpoint() ask in the cell
    stack_requests.answer_with(channel.send, rank)
    # The user's own DDP models too: freed after leaving the group, they can hang (ddp_teardown.py).
    ddp_teardown.hold_every_models_group_after_its_reducer()
    imports = _ImportReporter(channel, rank, modules_at_fork) if spec.report_imports else None
    # One worker per node reports at milestones (its peers import the same); all at the end.
    early = imports.report if imports is not None and local_rank == 0 else None
    exitcode = 1
    try:
        with sending_to(_channel_destination(channel, rank, milestone=early)):
            exitcode = _run(spec, local_rank, rank, channel)
            if imports is not None:
                imports.report()
    finally:
        with contextlib.suppress(OSError):
            channel.flush()  # metrics still waiting for their batch
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(exitcode)


# The forking process's __main__, kept alive in a worker that has its own (own_main).
_FORKING_PROCESS_MAIN: types.ModuleType | None = None

# This worker's link to the launching process.
_CHANNEL: ChannelWriter | None = None


def current_channel() -> ChannelWriter:
    """This worker's link: its events go up, prompt answers and live calls come down
    (inside a worker only)."""
    if _CHANNEL is None:
        raise RuntimeError("not inside a launched worker")
    return _CHANNEL


def _run(spec: WorkerSpec, local_rank: int, rank: int, channel: ChannelWriter) -> int:
    """Call the function and send back what came of it; return the exit status."""
    try:
        spec = spec.unpacked()
        value = _call_user_function(spec, local_rank)
        _send_peak_resources(channel, rank)
        if spec.returns_value(rank):
            _send_result(channel, rank, value)
        # Every rank finishes its last collective before any of them exits: exiting tears
        # down the sockets, and a peer still reading the last message of a collective
        # would see "connection reset" instead of its data.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except SystemExit as stop:  # as Python exits: None is 0, what is no int is printed, 1
        exitcode = 0 if stop.code is None else stop.code
        if not isinstance(exitcode, int):
            print(exitcode, file=sys.stderr)
            exitcode = 1
        if exitcode:
            channel.send(_raised(rank, stop, spec.function))
        return exitcode
    except BaseException as error:  # noqa: BLE001 - every failure must reach the kernel
        _send_peak_resources(channel, rank)
        debug = spec.post_mortem and isinstance(error, Exception)
        channel.send(_raised(rank, error, spec.function, post_mortem=debug))
        if debug:
            debugging.post_mortem(error, _user_frames(error, spec.function), rank)
        return 1
    return 0


def _call_user_function(spec: WorkerSpec, local_rank: int) -> Any:
    # A worker's traceback is cut below this frame (see _user_traceback).
    return spec.run(spec.function, spec.args, spec.kwargs, local_rank, spec.local_world_size)


def _channel_destination(
    channel: ChannelWriter, rank: int, milestone: Callable[[], None] | None = None
) -> Destination:
    """Metrics, progress (at most PROGRESS_UPDATES_PER_SECOND) and milestones, to the launcher."""
    last_sent = [0.0]

    def send_progress(step: int, total: int | None, elapsed: float) -> None:
        now = time.monotonic()
        final = total is not None and step >= total
        if final or step == 0 or now - last_sent[0] >= 1 / PROGRESS_UPDATES_PER_SECOND:
            last_sent[0] = now
            channel.send(Progress(rank, step, total, elapsed))

    return Destination(
        metric=functools.partial(channel.send, batch=True),
        progress=send_progress,
        milestone=milestone,
        checkpoint=lambda path: channel.send(CheckpointSaved(rank, path)),
    )


def _send_peak_resources(channel: ChannelWriter, rank: int) -> None:
    peaks = PeakResources(
        rank,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_gpu_bytes=platform_named(os.environ.get(ENV_BACKEND) or "cpu").peak_device_bytes(),
    )
    with contextlib.suppress(OSError):  # the launcher is already gone; nothing to report to
        channel.send(peaks)


class _ImportReporter:
    """Tells the launcher which modules this worker imported since it last said (launch/warm.py)."""

    def __init__(self, channel: ChannelWriter, rank: int, modules_at_fork: int):
        self.channel, self.rank, self.count = channel, rank, modules_at_fork

    def report(self) -> None:
        if len(sys.modules) <= self.count:  # the usual case after the first milestone
            return
        modules = imported_since(self.count)
        self.count = len(sys.modules)
        with contextlib.suppress(Exception):  # only the next launch's speed depends on it
            self.channel.send(ModulesImported(self.rank, modules))


def _send_result(channel: ChannelWriter, rank: int, value: Any) -> None:
    try:
        channel.send(Result(rank, to_cpu(value)))
    except Exception as error:  # noqa: BLE001
        raise TypeError(
            f"the training function returned a {type(value).__name__} that cannot be sent "
            f"back to the notebook ({error}); return tensors, numbers, strings, or "
            "containers of them"
        ) from error


def _raised(
    rank: int, error: BaseException, function: Callable[..., Any], post_mortem: bool = False
) -> WorkerRaised:
    return WorkerRaised(
        rank,
        exception=f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
        traceback=_user_traceback(error, function),
        time=time.time(),
        post_mortem=post_mortem,
    )


def _user_traceback(error: BaseException, function: Callable[..., Any]) -> str:
    """The traceback from the user's function down, without the launcher's frames."""
    return "".join(traceback.format_exception(type(error), error, _user_frames(error, function)))


def _user_frames(error: BaseException, function: Callable[..., Any]) -> TracebackType | None:
    """Where the user's part of `error`'s traceback starts.

    At the first frame of `function` itself; where that is not on the way
    (the backend failed before calling it, or the function is a callable
    whose code cannot be told), right below `_call_user_function`; failing
    both (an error in sending the result), at the last frame.
    """
    while isinstance(function, functools.partial):
        function = function.func
    code = getattr(function, "__code__", None)  # functions, and bound methods through __func__
    if code is None:  # an object with a __call__ method
        code = getattr(inspect.getattr_static(type(function), "__call__", None), "__code__", None)
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    first = next((f for f in frames if f.tb_frame.f_code is code), None)
    call = _call_user_function.__code__
    below = next((b for a, b in itertools.pairwise(frames) if a.tb_frame.f_code is call), None)
    return first or below or (frames[-1] if frames else None)


def _redirect_output(pipes: WorkerPipes) -> None:
    """Point fd 1 and 2 at the launcher's pipes and sys.stdout/stderr at the pipe
    they share (launch/output_pipes.py).

    In a notebook, sys.stdout is the kernel's own stream object, which a forked
    child must not use; logging handlers made earlier may still point at it.
    """
    old_streams = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    for fd, standard in ((pipes.stdout, 1), (pipes.stderr, 2)):
        os.dup2(fd, standard)
        os.close(fd)
    sys.stdout, sys.stderr = python_streams(pipes.python)
    # Installed afresh: in a process where faulthandler was already on (pytest, a
    # kernel), enable() only changes its file, and a crash handler a library installed
    # later (Ray's, after ray.init) would swallow a crashed worker's Python stack.
    faulthandler.disable()
    faulthandler.enable(file=sys.stderr)
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old_streams:
                # Assign rather than setStream(): that would flush the kernel's stream.
                handler.stream = getattr(sys, old_streams[id(handler.stream)])
