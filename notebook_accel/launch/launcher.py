"""notebook_launcher: check the inputs, pick the backend, run the workers, return."""

from __future__ import annotations

import inspect
import os
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from notebook_accel.config import LaunchConfig, LaunchSettings
from notebook_accel.launch.errors import WorkerError
from notebook_accel.launch.observers import ConsoleObserver, ObserverGroup, RunObserver
from notebook_accel.launch.preflight import LaunchPlan, plan_launch
from notebook_accel.launch.workers import StopSignal, WorkerGroup
from notebook_accel.metrics import MetricRecord


@dataclass
class RunReport:
    """What the latest launch did; `last_run()` returns it.

    `metrics` holds every `Accelerator.log` record in arrival order;
    `resources` each rank's memory figures (`rss_bytes` live, `peak_rss_bytes`
    and, on GPUs, `peak_gpu_bytes` at the end); `progress` the main
    process's latest progress-bar position.
    """

    status: str = "starting"  # starting, running, finished, failed, stopped, timed out
    world_size: int = 0
    backend: str = ""
    mixed_precision: str = "no"
    results: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    restarts: int = 0
    started_at: float = 0.0
    duration: float = 0.0
    metrics: list[MetricRecord] = field(default_factory=list)
    resources: dict[int, dict[str, int]] = field(default_factory=dict)
    progress: dict[str, Any] | None = None

    def history(self, name: str, rank: int | None = None) -> list[tuple[int | None, Any]]:
        """(step, value) pairs of one metric, in the order they were logged."""
        return [
            (r.step, r.values[name])
            for r in self.metrics
            if name in r.values and (rank is None or r.rank == rank)
        ]

    def to_dataframe(self):
        """The metric history as a pandas DataFrame: step, rank, time, one column per metric."""
        try:
            import pandas
        except ImportError:
            raise ImportError("to_dataframe() needs pandas: pip install pandas") from None
        rows = [{"step": r.step, "rank": r.rank, "time": r.time, **r.values} for r in self.metrics]
        return pandas.DataFrame(rows)


class _HistoryObserver(RunObserver):
    """Keeps the run's metrics, progress and resource figures in its report."""

    def __init__(self, report: RunReport):
        self.report = report

    def on_message(self, rank: int, kind: str, payload: Any) -> None:
        if kind == "metric":
            self.report.metrics.append(payload)
        elif kind == "progress":
            self.report.progress = payload
        elif kind == "resources":
            figures = self.report.resources.setdefault(rank, {})
            peak = max(
                figures.get("peak_rss_bytes", 0),
                payload.get("peak_rss_bytes", 0),
                payload.get("rss_bytes", 0),
            )
            figures.update(payload)
            figures["peak_rss_bytes"] = peak


_last_run = RunReport()


def last_run() -> RunReport:
    """The report of the most recent `notebook_launcher` call in this process."""
    return _last_run


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple | list = (),
    num_processes: int | None = None,
    mixed_precision: str | None = "no",
    use_port: int | str | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    *,
    kwargs: dict[str, Any] | None = None,
    config: LaunchConfig | str | os.PathLike | None = None,
    backend: str | None = None,
    devices: list[int] | None = None,
    gradient_accumulation_steps: int = 1,
    max_restarts: int = 0,
    timeout: float | None = None,
    return_all: bool = False,
    output: str = "all",
    live: bool | None = None,
    threads_per_process: int | None = None,
    observers: list[RunObserver] | None = None,
    fsdp: Any = None,
    **unknown: Any,
) -> Any:
    """Run `function(*args)` in one worker process per device and return its result.

    Workers are forked from this process, so a function defined in a notebook
    cell works as it is. CPU workers form a gloo process group, GPU workers an
    nccl one (one GPU each). Every input is checked before anything starts.

    Args:
        function: the training function; it runs once in every worker.
        args: positional arguments for `function`.
        num_processes: how many workers. Default: every GPU, or 2 CPU workers.
            With 1, `function` runs right here, in this process.
        mixed_precision: "no", "fp16", "bf16" or "fp8"; `Accelerator()` in the
            workers uses it unless told otherwise.
        use_port: the rendezvous port. Default: a free one (29500 across nodes).
        master_addr, node_rank, num_nodes: for a run over several machines,
            each calling `notebook_launcher` with its own `node_rank`.
        kwargs: keyword arguments for `function`.
        config: a `LaunchConfig` or the path of its YAML file (the panel's
            "Save"); options passed here with other than their default win.
        backend: "cpu", "cuda" or "xla" (TPUs) to override what the hardware suggests.
        devices: which GPUs to use, by index (default: the first `num_processes`).
        gradient_accumulation_steps: picked up by `Accelerator()` in the workers.
        max_restarts: how many times to restart all workers after a failure.
        timeout: seconds for the whole run; then the workers are stopped and
            TimeoutError is raised.
        return_all: return every rank's value as a list ordered by rank.
        output: "all" (other ranks' lines prefixed), "main" or "none".
        live: show progress, metrics and a loss curve while the run goes
            (default: as widgets in a notebook, as text lines in a script).
        threads_per_process: torch threads in each worker (default 1; see README).
        observers: extra receivers of the run's events (output, metrics, exits).
        fsdp: shard models with FSDP2 in the workers' `prepare`: True, or a dict of
            `FullyShardedDataParallelPlugin` fields (the YAML's `fsdp:` section).

    Returns:
        The main worker's return value, tensors moved to the CPU; with
        `return_all`, a list of every worker's value on this node. The run's
        metric history and resource figures are in `last_run()`.

    Raises:
        WorkerError: a worker raised, exited non-zero or was killed; it names the
            rank and carries the worker's traceback. The other workers are stopped.
        TimeoutError: `timeout` passed.
        KeyboardInterrupt: the run was interrupted; the workers are stopped.
    """
    options = {
        "num_processes": num_processes,
        "mixed_precision": mixed_precision,
        "use_port": use_port,
        "master_addr": master_addr,
        "node_rank": node_rank,
        "num_nodes": num_nodes,
        "backend": backend,
        "devices": devices,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "max_restarts": max_restarts,
        "timeout": timeout,
        "fsdp": fsdp,
    }
    if config is not None:
        options = _merged_with_config(options, config)
    plan = plan_launch(
        function=function,
        args=args,
        kwargs=kwargs,
        return_all=return_all,
        output=output,
        threads_per_process=threads_per_process,
        unknown=unknown,
        **options,
    )
    console = ConsoleObserver(output, main_rank=plan.node_rank * plan.local_world_size)
    extra = list(observers or [])
    if live is None or live:
        from notebook_accel.ui.live import live_view

        view = live_view(plan, force=bool(live))
        if view is not None:
            extra.append(view)
    return run_plan(plan, ObserverGroup([console, *extra]))


def _merged_with_config(options: dict[str, Any], config: Any) -> dict[str, Any]:
    if not isinstance(config, LaunchConfig):
        config = LaunchConfig.load(config)
    defaults = inspect.signature(notebook_launcher).parameters
    merged = config.launch_options()
    for name, value in options.items():
        if value != defaults[name].default:
            merged[name] = value
    return merged


def run_plan(plan: LaunchPlan, observer: RunObserver, stop: StopSignal | None = None) -> Any:
    """Run a checked launch plan; the panel and the command line call this too.

    `stop` lets another thread end the run (then KeyboardInterrupt is raised).
    """
    global _last_run
    report = RunReport(
        world_size=plan.world_size,
        backend=plan.backend.name,
        mixed_precision=plan.settings.mixed_precision,
        started_at=time.time(),
    )
    _last_run = report
    observer = ObserverGroup([_HistoryObserver(report), observer])
    error: BaseException | None = None
    try:
        if plan.in_process:
            results = _run_in_process(plan, observer, report)
        else:
            results = _run_workers(plan, observer, report, stop)
        report.status = "finished"
        report.results = results
    except KeyboardInterrupt as interrupt:
        report.status, error = "stopped", interrupt
        raise
    except TimeoutError as timeout:
        report.status, error = "timed out", timeout
        raise
    except BaseException as failure:
        report.status, error = "failed", failure
        raise
    finally:
        report.error = error
        report.duration = time.time() - report.started_at
        observer.on_end(error)
    return _returned(plan, results)


def _returned(plan: LaunchPlan, results: dict[int, Any]) -> Any:
    first = plan.node_rank * plan.local_world_size
    if plan.return_all:  # None where a worker returned nothing (sys.exit(0))
        return [results.get(rank) for rank in range(first, first + plan.local_world_size)]
    return results.get(first)


def _run_workers(
    plan: LaunchPlan, observer: RunObserver, report: RunReport, stop: StopSignal | None
) -> dict[int, Any]:

    deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
    for attempt in range(plan.max_restarts + 1):
        if stop is not None and stop.is_set():  # Stop pressed while restarting
            raise KeyboardInterrupt("the run was stopped")
        with _Rendezvous(plan) as rendezvous:
            group = WorkerGroup(
                plan.worker_spec(rendezvous.port, attempt),
                observer,
                stop,
                close_in_workers=rendezvous.fds(),
            )
            try:
                observer.on_start(plan.local_world_size, attempt)
                group.start()
                rendezvous.serve()
                report.status = "running"
                group.wait(deadline)
                return group.results
            except WorkerError as failure:
                if attempt == plan.max_restarts:
                    raise
                report.restarts += 1
                observer.on_restart(attempt + 1, failure)
            except TimeoutError:
                raise TimeoutError(
                    f"the run did not finish within timeout={plan.timeout} s; "
                    "every worker was stopped"
                ) from None
            finally:
                group.stop()
    raise AssertionError("unreachable")


def _run_in_process(plan: LaunchPlan, observer: RunObserver, report: RunReport) -> dict[int, Any]:
    """num_processes=1: call the function here, so debuggers and %debug work."""
    import torch.distributed as dist

    from notebook_accel import metrics, progress
    from notebook_accel.nested import to_cpu

    def progress_to_observer(step: int, total: int | None, elapsed: float) -> None:
        observer.on_message(0, "progress", {"step": step, "total": total, "elapsed": elapsed})

    was_initialized = dist.is_available() and dist.is_initialized()
    with (
        _Rendezvous(plan) as rendezvous,
        _patched_environ(plan.environment(rendezvous.port, attempt=0)),
    ):
        rendezvous.serve()
        report.status = "running"
        observer.on_start(plan.local_world_size, 0)
        previous_sink = metrics.set_local_sink(
            lambda record: observer.on_message(0, "metric", record)
        )
        previous_hook = progress.set_progress_hook(progress_to_observer)
        try:
            value = plan.function(*plan.args, **plan.kwargs)
        finally:
            metrics.set_local_sink(previous_sink)
            progress.set_progress_hook(previous_hook)
            if not was_initialized and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return {0: to_cpu(value)}


class _Rendezvous:
    """The store the workers meet at, hosted here on node 0, as torchrun's agent does.

    The port is bound before the workers are forked, but the store's server
    thread starts only after they are: a thread running during a fork can hold
    a lock that the child then waits on forever (seen here as a worker stuck
    connecting to the store). Workers retry connecting until it answers.
    """

    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self.port = plan.port
        self._socket: socket.socket | None = None
        self._store = None

    def __enter__(self) -> _Rendezvous:
        if self.plan.node_rank == 0:
            # On one machine the store answers only there; across machines, on every
            # interface (the others reach it through master_addr).
            host = self.plan.master_addr if self.plan.num_nodes == 1 else ""
            self._socket = _listening_socket(host, self.plan.port)
            self.port = self._socket.getsockname()[1]
        return self

    def fds(self) -> list[int]:
        """File descriptors the forked workers must close."""
        return [self._socket.fileno()] if self._socket is not None else []

    def serve(self) -> None:
        if self._socket is None:
            return
        from datetime import timedelta

        import torch.distributed as dist

        self._store = dist.TCPStore(
            host_name=self.plan.master_addr,
            port=self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.plan.rendezvous_timeout),
            master_listen_fd=self._socket.fileno(),
        )
        self._socket.detach()  # the store owns the socket now and closes it
        self._socket = None

    def __exit__(self, *exc_info: Any) -> None:
        self._store = None  # stops the server thread
        if self._socket is not None:
            self._socket.close()


def _listening_socket(host: str, port: int | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # Reuse a port whose last run's connections are still in TIME_WAIT; a port
    # another program listens on still fails to bind.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port or 0))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise OSError(
            f"cannot listen on {host or 'this machine'} port {port} ({error.strerror}), so "
            "the workers cannot meet there: another run or program may be using it. On one "
            "machine leave use_port unset to pick a free port; otherwise choose another."
        ) from error
    return listener


@contextmanager
def _patched_environ(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


__all__ = ["notebook_launcher", "last_run", "run_plan", "RunReport", "LaunchSettings"]
