"""run_plan: run a checked launch plan to its end, with its report and observers; the
launcher, the panel, the command line and a detached run's keeper all run launches here."""

from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager
from typing import Any

from notebook_accel.launch import template
from notebook_accel.launch.attempt import open_group
from notebook_accel.launch.errors import PlacementError, WorkerError
from notebook_accel.launch.plan import LaunchPlan
from notebook_accel.launch.preflight import with_start_method
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
from notebook_accel.reporting.observers import RunFeed, RunObserver
from notebook_accel.reporting.report import RunReport

_last_run = RunReport()


def last_run() -> RunReport:
    """The report of the most recently started launch in this process.

    Each launch has a report of its own: a launch started later (say, from a
    panel while a cell's launch runs) does not change an earlier one's.
    """
    return _last_run


def run_plan(
    plan: LaunchPlan,
    observer: RunObserver,
    stop: StopSignal | None = None,
    report: RunReport | None = None,
) -> Any:
    """Run a checked launch plan.

    Every event of the run is folded into `report` (a new one unless given),
    then handed to `observer` with it. `stop` lets another thread end the run
    (then KeyboardInterrupt is raised).
    """
    global _last_run
    report = plan.new_report() if report is None else report
    if not report.started_at:
        report.started_at = time.time()
    _last_run = report
    feed = RunFeed(report, [observer])

    warmer = _warmer_for(plan, report)

    def emit(event: RunEvent) -> None:
        if isinstance(event, ModulesImported):
            if plan.start_method == "forkserver":  # the template warms, not this process
                template.preload(event.modules)
            else:
                warmer.offer(event.modules)
        feed(event)

    error: BaseException | None = None
    try:
        if plan.in_process:
            _run_in_process(plan, emit)
        else:
            with interrupts_stop(stop) as stop_or_interrupt:
                if plan.start_method == "fork":
                    # What earlier launches left queued is imported before the workers
                    # start. If that started a device runtime (a module past warming's
                    # guard), this process can no longer fork device workers: they start fresh.
                    import_worker_code()
                    plan = with_start_method(plan, "auto") if warmer.start() else plan
                if plan.fresh_start_reason:
                    warnings.warn(fresh_start_message(plan), FreshStartWarning, stacklevel=2)
                _run_workers(plan, emit, stop_or_interrupt)
    except BaseException as failure:
        error = failure
        raise
    finally:
        emit(RunEnded(error))
        # Queues what the workers imported for later: it never lengthens this call.
        warmer.finish(interrupted=isinstance(error, KeyboardInterrupt))
    first = plan.node_rank * plan.local_world_size
    if plan.return_all:  # None where a worker returned nothing (sys.exit(0))
        return [report.results.get(rank) for rank in range(first, first + plan.local_world_size)]
    return report.results.get(first)


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
        "and device tensors among them arrive on each worker's own device. To fork again, "
        "restart the kernel and touch the device only inside the training function (or pass "
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
