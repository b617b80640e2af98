"""One attempt's workers, started where the plan says: on this machine or on a cluster."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

from notebook_accel.launch.debugging import ask_in_cell
from notebook_accel.launch.plan import LaunchPlan
from notebook_accel.launch.rendezvous import Rendezvous
from notebook_accel.launch.supervisor import Emit, StopSignal, WorkerGroup, WorkerGroupBase


@contextmanager
def open_group(
    plan: LaunchPlan,
    emit: Emit,
    stop: StopSignal | None,
    attempt: int,
    interrupt: StopSignal | None = None,
) -> Iterator[WorkerGroupBase]:
    """Start the workers of attempt `attempt`; stop them,
    and release what they held, when the block ends.

    `stop` ends the group's waits for as long as it runs; `interrupt`, when set
    while the workers are still being placed and started, abandons the start
    (a cluster can take seconds there). Both raise KeyboardInterrupt.
    """
    if plan.cluster is not None:
        from notebook_accel.launch.cluster.group import open_cluster_group

        spec = plan.worker_spec(0, attempt)  # the cluster's group hosts the store
        timeout = plan.rendezvous_timeout
        opening = open_cluster_group(plan.cluster, spec, timeout, emit, stop, interrupt or stop)
        with opening as group:
            group.hang_after = plan.explain_hang_after
            group.prompter = ask_in_cell
            yield group
        return
    with Rendezvous.for_plan(plan, forks=True) as rendezvous:
        spec = plan.worker_spec(rendezvous.port, attempt)
        group = WorkerGroup(spec, emit, stop)
        group.hang_after = plan.explain_hang_after
        group.prompter = ask_in_cell  # a worker's input() and breakpoint() ask in the cell
        group.on_clean_exit = functools.partial(rendezvous.mark_left, attempt=attempt)
        try:
            group.start()
            rendezvous.serve()
            yield group
        finally:
            group.stop()
