"""`start_workers`: check the options, start a live group, let `%%on_workers` run on it."""

from __future__ import annotations

import dataclasses
from typing import Any

from notebook_accel.launch.preflight import plan_launch
from notebook_accel.live.group import LiveWorkers
from notebook_accel.live.magic import register_magic
from notebook_accel.live.serve import serve
from notebook_accel.reporting.observers import RunObserver


def start_workers(
    num_processes: int | None = None,
    *,
    observers: list[RunObserver] | None = None,
    live: bool | None = None,
    **options: Any,
) -> LiveWorkers:
    """Start one worker per device and keep them, with their process group, between cells.

    Takes `notebook_launcher`'s options (backend, mixed_precision, devices,
    start_method, ...), checked the same way before anything starts;
    `timeout` becomes every call's default timeout. `live`: show a live view
    of metrics under a cell whose call logs them (default: in a notebook).
    On a Ray cluster (`cluster="ray"`), `close()` frees the workers' agents,
    placement group, GPUs and CPUs; with `keep_warm=S` the agents stay up S
    seconds after it instead, for the next group or launch of the same shape.

    Returns the running group: `run(fn, *args)`, `run_cell(source)`,
    `restart()`, `close()`. In IPython it also enables `%%on_workers`.
    """
    if options.get("max_restarts"):
        raise ValueError(
            "max_restarts= restarts a launch; live workers keep state that a restart "
            "would lose. Call workers.restart() when you choose to."
        )
    plan = plan_launch(
        function=serve, num_processes=num_processes, single_in_process=False, **options
    )
    if plan.cluster is not None and "keep_warm" not in options:
        # close() means done: keep the agents warm only when the user asked for it
        # (a launch keeps them by default, for the next launch).
        plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, keep_warm=0.0))
    workers = LiveWorkers(plan, observers=observers, live=live)
    workers.start()
    register_magic(workers)
    return workers
