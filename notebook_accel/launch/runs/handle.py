"""Finding detached runs and bringing them into a cell: attach(), runs(), resume()."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from notebook_accel.launch.plan import ENV_RESUME_FROM
from notebook_accel.launch.runs.detached import DetachedRun
from notebook_accel.launch.runs.directory import CLUSTER_ID_PREFIX, find_run, run_directories
from notebook_accel.launch.runs.local import LocalRun
from notebook_accel.reporting.observers import ConsoleObserver


def find(run_id: str | None = None, ray_address: str | None = None) -> DetachedRun:
    """The run `run_id` (or a unique prefix), else the newest: on the Ray cluster for an id
    of a cluster run or with `ray_address`, else on this machine."""
    if ray_address is not None or (run_id or "").startswith(CLUSTER_ID_PREFIX):
        from notebook_accel.launch.runs.on_cluster import find_cluster_run

        return find_cluster_run(run_id, ray_address)
    return LocalRun(find_run(run_id))


def start(plan: Any) -> DetachedRun:
    """Start a checked launch plan under a keeper, where it runs: a detached actor of the
    Ray cluster for a cluster launch, else a process of this machine."""
    if plan.cluster is not None:
        from notebook_accel.launch.runs.on_cluster import ClusterRun

        return ClusterRun.start(plan)
    return LocalRun.start(plan)


def resume(run_id: str | None = None, live: bool | None = None) -> DetachedRun:
    """Start a lost, failed or stopped run (the newest, or `run_id`) again, detached, from
    the newest checkpoint it saved (`DetachedRun.resume`); its live view follows it under
    this cell, as a detached launch's does (`live=False`: none)."""
    return _follow_in_background(find(run_id).resume(), live)


def resume_checkpoint() -> str | None:
    """In a worker of a resumed run, the checkpoint to go on from (pass it to
    `accelerator.load_state`); None in a run that starts from scratch."""
    return os.environ.get(ENV_RESUME_FROM) or None


@dataclass(frozen=True)
class RunSummary:
    """One line of `runs()`."""

    id: str
    function: str
    state: str
    started: float
    world_size: int
    checkpoint: str | None

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        line = f"{self.id}  {self.state:<9}  {when}  {self.function} x{self.world_size}"
        return line + (f"  checkpoint {self.checkpoint}" if self.checkpoint else "")


class RunList(list):
    """`runs()`: a list of RunSummary, shown as a table."""

    def __repr__(self) -> str:
        return "\n".join(map(str, self)) or "no detached runs"


def runs(ray_address: str | None = None) -> RunList:
    """This user's detached runs on this machine, and on the Ray cluster this kernel is
    connected to (or `ray_address` names), the oldest first, with their state."""
    found = RunList(_summary(d.read(), d.state()) for d in run_directories())
    ray = sys.modules.get("ray")
    if ray_address is not None or (ray is not None and ray.is_initialized()):
        from notebook_accel.launch.runs.on_cluster import cluster_runs

        found += [_summary(run.record, run.record.state) for run in cluster_runs(ray_address)]
    return found


def _summary(record: Any, state: str) -> RunSummary:
    return RunSummary(
        record.id, record.function, state, record.created, record.world_size, record.checkpoint
    )


def attach(
    run_id: str | None = None,
    wait: bool = True,
    live: bool | None = None,
    ray_address: str | None = None,
) -> Any:
    """Bring a detached run (the newest, or `run_id`) into this cell.

    The cell shows what an attached launch shows: each rank's output so far and
    from then on, the progress, metrics and loss curve. With `wait` (the
    default) it returns what the launch would have returned, or raises its
    error, once the run ends; interrupting the cell leaves the run running (it
    says how to stop it). With `wait=False` it returns the `DetachedRun` at once,
    the view following the run in the background. A run on a Ray cluster is found
    there: by its id ("ray-..."), or the newest with `ray_address`.
    """
    run = find(run_id, ray_address)
    if not wait:
        return _follow_in_background(run, live)
    run.add_observer(ConsoleObserver(run.record.output, main_rank=run.record.main_rank))
    if live is not False:
        from notebook_accel.views.live import live_view

        run.add_observer(live_view(force=bool(live)))
    try:
        run.wait()
    except KeyboardInterrupt:
        print(
            f"notebook_accel: stopped following run {run.id}; it goes on. "
            f'attach("{run.id}") follows it again; attach("{run.id}", wait=False).stop() '
            "stops it.",
            file=sys.stderr,
        )
        raise
    return run.result()


def _follow_in_background(run: DetachedRun, live: bool | None) -> DetachedRun:
    """`run`, its live view (none with `live=False`) following it from a thread."""
    if live is not False:
        from notebook_accel.views.live import WidgetView, live_view

        view = live_view(force=True, output="open")  # drawn from a thread: see the launcher
        if isinstance(view, WidgetView):
            view.show()
        run.follow_in_background(view)
    return run
