"""notebook_launcher: check the inputs, pick the backend, run the workers, return."""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from notebook_accel.config.settings import LaunchSettings
from notebook_accel.launch import template
from notebook_accel.launch.attempt import open_group
from notebook_accel.launch.errors import PlacementError, WorkerError
from notebook_accel.launch.options import (
    LaunchConfig,
    merged_with_file,
    name_positionals,
    signature_parameters,
)
from notebook_accel.launch.options import docstring as options_docstring
from notebook_accel.launch.preflight import LaunchPlan, choose_start_method, plan_launch
from notebook_accel.launch.rendezvous import Rendezvous
from notebook_accel.launch.supervisor import Emit, StopSignal, interrupts_stop
from notebook_accel.launch.warm import RunWarmer, import_worker_code
from notebook_accel.reporting.destination import Destination, sending_to
from notebook_accel.reporting.events import (
    AttemptStarted,
    ModulesImported,
    Progress,
    Restarting,
    Result,
    RunEnded,
    RunEvent,
)
from notebook_accel.reporting.observers import ConsoleObserver, ObserverGroup, RunObserver
from notebook_accel.reporting.report import RunReport

# The report of the most recently started launch in this process (each run
# has its own; this is only which one `last_run()` answers with).
_last_run = RunReport()


def last_run() -> RunReport:
    """The report of the most recently started launch in this process.

    Each launch has a report of its own: a launch started later (say, from a
    panel while a cell's launch runs) does not change an earlier one's.
    """
    return _last_run


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple | list = (),
    *positional: Any,
    kwargs: dict[str, Any] | None = None,
    config: LaunchConfig | str | os.PathLike | None = None,
    live: bool | None = None,
    observers: list[RunObserver] | None = None,
    detach: bool = False,
    **options: Any,
) -> Any:
    """Run `function(*args)` in one worker process per device and return its result.

    Workers are forked from this process, so a function defined in a notebook
    cell works as it is. CPU workers form a gloo process group, GPU workers an
    nccl one (one GPU each). Every input is checked before anything starts.
    After `args` come Accelerate's positional options (num_processes,
    mixed_precision, use_port, master_addr, node_rank, num_nodes).

    Args:
        function: the training function; it runs once in every worker.
        args: positional arguments for `function`.
        kwargs: keyword arguments for `function`.
        config: a `LaunchConfig` or the path of its YAML file (the panel's
            "Save"); every option passed here wins over the file's.
        live: show progress, metrics and a loss curve while the run goes
            (default: as widgets in a notebook, as text lines in a script).
        observers: extra receivers of the run's events (output, metrics, exits).
        detach: run under a process of its own instead of this kernel's: the run
            goes on if the kernel restarts or dies, and any kernel can `attach()`
            to it (docs/guides/detached-runs.md). Returns a `DetachedRun` at once.

    {options}

    Returns:
        The main worker's return value, tensors moved to the CPU; with
        `return_all`, a list of every worker's value on this node. The run's
        metric history and resource figures are in `last_run()`. With
        `detach`, the run's `DetachedRun` (its `result()` is that value).

    Raises:
        WorkerError: a worker raised, exited non-zero or was killed; it names the
            rank and carries the worker's traceback. The other workers are stopped.
        TimeoutError: `timeout` passed.
        KeyboardInterrupt: the run was interrupted; the workers are stopped.
    """
    given = name_positionals(positional, options)
    if config is not None:
        given = merged_with_file(given, config)
    if detach and given.get("cluster") is not None:
        raise ValueError(
            "detach=True runs the workers on this machine; a run on a Ray cluster cannot be "
            "detached yet. Launch it without detach, or without cluster= to run here."
        )
    plan = plan_launch(function=function, args=args, kwargs=kwargs, **given)
    if detach:
        return _start_detached(plan, live, observers)
    main_rank = plan.node_rank * plan.local_world_size
    console = ConsoleObserver(plan.output, main_rank=main_rank)
    extra = list(observers or [])
    if live is None or live:
        from notebook_accel.views.live import live_view

        view = live_view(plan, force=bool(live))
        if view is not None:
            extra.append(view)
    return run_plan(plan, ObserverGroup([console, *extra]))


def _start_detached(plan: LaunchPlan, live: bool | None, observers: list | None) -> Any:
    """Start the run under a keeper process; its view follows it under this cell."""
    from notebook_accel.launch.runs.handle import start_detached

    # A single worker too runs in a process of its own: the kernel may go away.
    run = start_detached(dataclasses.replace(plan, single_in_process=False))
    extra = list(observers or [])
    if live is None or live:
        from notebook_accel.views.live import WidgetView, live_view

        # The view is drawn from a thread that follows the run: it shows the output
        # too, since this cell prints nothing once it has returned.
        view = live_view(plan, force=True, output="open")
        if isinstance(view, WidgetView):
            view.show()  # under this cell, before it returns
        if view is not None:
            extra.append(view)
    if extra:
        run.follow_in_background(ObserverGroup(extra))
    return run


# The options are defined once (launch/options.py); help() and a notebook's
# Shift-Tab show them as keyword parameters, with their defaults and help.
notebook_launcher.__signature__ = inspect.signature(notebook_launcher).replace(
    parameters=[
        *[
            parameter
            for parameter in inspect.signature(notebook_launcher).parameters.values()
            if parameter.kind is not inspect.Parameter.VAR_POSITIONAL
            and parameter.kind is not inspect.Parameter.VAR_KEYWORD
        ],
        *signature_parameters(),
    ]
)
notebook_launcher.__doc__ = notebook_launcher.__doc__.replace(
    "{options}", options_docstring().replace("\n", "\n    ")
)


def debug_launcher(
    function: Callable[..., Any], args: tuple | list = (), num_processes: int = 2, **options: Any
) -> Any:
    """Run `function(*args)` in `num_processes` CPU worker processes, to test distributed code
    on any machine (Accelerate's `debug_launcher`).

    `notebook_launcher` with `backend="cpu"` and `mixed_precision="no"`, whatever the
    hardware: the workers form a gloo group and `Accelerator()` in them uses the CPU.
    Returns the main worker's value (Accelerate's returns None) and raises
    `WorkerError` as `notebook_launcher` does; other `notebook_launcher` options
    (`timeout=`, `output=`, ...) may be passed too. One process runs in this process.
    """
    for fixed in ("backend", "mixed_precision"):
        if fixed in options:
            raise TypeError(
                f"debug_launcher runs CPU workers without mixed precision; it takes no "
                f"{fixed}=. Use notebook_launcher(..., {fixed}=...) for that."
            )
    return notebook_launcher(
        function,
        args,
        num_processes=num_processes,
        backend="cpu",
        mixed_precision="no",
        **options,
    )


def run_plan(
    plan: LaunchPlan,
    observer: RunObserver,
    stop: StopSignal | None = None,
    report: RunReport | None = None,
) -> Any:
    """Run a checked launch plan; the panel and the command line call this too.

    Every event of the run is folded into `report` (a new one unless given),
    then handed to `observer` with it. `stop` lets another thread end the run
    (then KeyboardInterrupt is raised).
    """
    global _last_run
    if report is None:
        report = plan.new_report()
    if not report.started_at:
        report.started_at = time.time()
    _last_run = report
    observers = ObserverGroup([observer])

    warmer = _warmer_for(plan, report)

    def emit(event: RunEvent) -> None:
        report.apply(event)
        if isinstance(event, ModulesImported):
            if plan.start_method == "forkserver":  # the template warms, not this process
                template.preload(event.modules)
            else:
                warmer.offer(event.modules)
        observers.on_event(event, report)

    error: BaseException | None = None
    if plan.fresh_start_reason:
        warnings.warn(fresh_start_message(plan), FreshStartWarning, stacklevel=2)
    try:
        if plan.in_process:
            _run_in_process(plan, emit)
        else:
            # A stop press anywhere in the launch becomes a request the launch
            # answers with KeyboardInterrupt, after stopping every worker.
            with interrupts_stop(stop) as stop_or_interrupt:
                plan = _warm_before_start(plan, warmer)
                _run_workers(plan, emit, stop_or_interrupt)
    except BaseException as failure:
        error = failure
        raise
    finally:
        emit(RunEnded(error))
        # Queues what the workers imported for later: it never lengthens this call.
        warmer.finish(interrupted=isinstance(error, KeyboardInterrupt))
    return _returned(plan, report.results)


class FreshStartWarning(UserWarning):
    """The workers do not fork from this process, which can no longer fork them: they fork
    from a clean process started once (launch/template.py)."""


def fresh_start_message(plan: LaunchPlan) -> str:
    """Why this launch starts slower, and what would make launches fast again."""
    return (
        "Starting the workers from a clean process started once, instead of forking this "
        f"one: {plan.fresh_start_reason}. The first such launch is about 1.5-2 s slower "
        "(that process imports torch); later ones are about as fast as forking. "
        "Everything works as usual; the function and its arguments are pickled by value, "
        "and GPU tensors among them arrive on each worker's own device. To fork again, "
        "restart the kernel and touch the GPU only inside the training function (or pass "
        "start_method='forkserver' to choose this start without this message)."
    )


def _warmer_for(plan: LaunchPlan, report: RunReport) -> RunWarmer:
    """What imports here what the workers had to import, so the next launch's workers have it."""
    if plan.in_process:  # the function runs here: whatever it imports is here already
        report.warming.finish("not needed")
    elif plan.cluster is not None:  # the workers fork from the nodes' agents, which warm
        report.warming.finish("on the cluster")
    elif plan.start_method == "forkserver" and plan.warm:  # launch/template.py warms
        report.warming.finish("in the template")
    return RunWarmer(report.warming, enabled=plan.warm)


def _warm_before_start(plan: LaunchPlan, warmer: RunWarmer) -> LaunchPlan:
    """Import what earlier launches left queued, before this launch's workers start.

    If that started a device runtime after all (a module past warming's guard),
    this process can no longer fork device workers: they start fresh instead.
    """
    if plan.start_method != "fork":
        return plan
    import_worker_code()
    if not warmer.start():
        return plan
    method, reason = choose_start_method("auto", plan.platform, plan.args, plan.kwargs)
    plan = dataclasses.replace(plan, start_method=method, fresh_start_reason=reason)
    if reason:
        warnings.warn(fresh_start_message(plan), FreshStartWarning, stacklevel=3)
    return plan


def _returned(plan: LaunchPlan, results: dict[int, Any]) -> Any:
    first = plan.node_rank * plan.local_world_size
    if plan.return_all:  # None where a worker returned nothing (sys.exit(0))
        return [results.get(rank) for rank in range(first, first + plan.local_world_size)]
    return results.get(first)


def _run_workers(plan: LaunchPlan, emit: Emit, stop: StopSignal | None) -> None:
    deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
    failure: WorkerError | None = None
    for attempt in range(plan.max_restarts + 1):
        if stop is not None and stop.is_set():  # Stop pressed while restarting
            raise KeyboardInterrupt("the run was stopped")
        emit(AttemptStarted(plan.local_world_size, attempt))
        try:
            with open_group(plan, emit, stop, attempt) as group:
                group.wait(deadline)
                return
        except WorkerError as error:
            if attempt == plan.max_restarts:
                raise
            failure = error
            emit(Restarting(attempt + 1, failure))
        except PlacementError as error:
            if failure is None:
                raise
            raise WorkerError(
                failure.failures, ending=f"the workers could not be started again: {error}"
            ) from error
        except TimeoutError:
            raise TimeoutError(
                f"the run did not finish within timeout={plan.timeout} s; every worker was stopped"
            ) from None
    raise AssertionError("unreachable")


def _run_in_process(plan: LaunchPlan, emit: Emit) -> None:
    """num_processes=1: call the function here, so debuggers and %debug work."""
    import torch.distributed as dist

    from notebook_accel.training.nested import to_cpu

    def progress(step: int, total: int | None, elapsed: float) -> None:
        emit(Progress(0, step, total, elapsed))

    was_initialized = dist.is_available() and dist.is_initialized()
    with (
        Rendezvous.for_plan(plan) as rendezvous,
        _patched_environ(plan.environment(rendezvous.port, attempt=0)),
    ):
        rendezvous.serve()
        emit(AttemptStarted(plan.local_world_size, 0))
        try:
            with sending_to(Destination(metric=emit, progress=progress)):
                value = plan.function(*plan.args, **plan.kwargs)
        finally:
            if not was_initialized and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    emit(Result(0, to_cpu(value)))


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
