"""LaunchPlan, which launch/preflight.py makes (every check happens there); the launcher,
the attempts, the groups of workers here and on a cluster run it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from notebook_accel.config.settings import RENDEZVOUS_TIMEOUT_SECONDS, LaunchSettings
from notebook_accel.launch.worker import WorkerSpec
from notebook_accel.platforms.base import Platform
from notebook_accel.reporting.report import RunReport

if TYPE_CHECKING:
    from notebook_accel.launch.cluster.request import ClusterRequest

# Where a worker of a resumed detached run finds its checkpoint (resume_checkpoint()).
ENV_RESUME_FROM = "NOTEBOOK_ACCEL_RESUME_FROM"


@dataclass(frozen=True)
class LaunchPlan:
    """A checked launch: everything needed to start the workers."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    platform: Platform
    settings: LaunchSettings
    local_world_size: int
    num_nodes: int
    node_rank: int
    master_addr: str
    port: int | None
    devices: list[int] | None
    max_restarts: int
    timeout: float | None
    return_all: bool
    output: str
    threads_per_process: int
    rendezvous_timeout: float = RENDEZVOUS_TIMEOUT_SECONDS
    explain_hang_after: float | None = None
    # A single worker runs in this process unless a caller (the panel, which
    # must be able to stop it) asks for a worker process anyway.
    single_in_process: bool = True
    warm: bool = True
    # "fork", "forkserver" (launch/template.py) or "spawn" (launch/fresh.py), and why
    # the fork start could not be used when start_method="auto" chose forkserver.
    start_method: str = "fork"
    fresh_start_reason: str | None = None
    # Where the workers run when not on this machine: a Ray cluster's request
    # (launch/cluster/request.py), with the function and arguments packed for it.
    cluster: ClusterRequest | None = None
    post_mortem: bool = False
    # A resumed detached run's checkpoint, which its workers find through
    # resume_checkpoint() (launch/runs).
    resume_from: str | None = None

    @property
    def world_size(self) -> int:
        return self.local_world_size * self.num_nodes

    @property
    def in_process(self) -> bool:
        # A chosen GPU other than the first needs a worker of its own: this
        # process cannot narrow the GPUs it sees after the fact.
        one_here = self.world_size == 1 and self.single_in_process and self.cluster is None
        return one_here and self.devices in (None, [0])

    def environment(self, port: int, attempt: int) -> dict[str, str]:
        """Variables every worker of this node gets (the rank ones come per worker)."""
        env = {
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(port),
            # The launching process hosts the store, as torchrun's agent does, so
            # init_process_group(init_method="env://") connects on every rank.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "OMP_NUM_THREADS": str(self.threads_per_process),
        }
        if self.in_process:
            env.update({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "NODE_RANK": "0"})
        env.update(self.settings.to_env())
        if self.resume_from:
            env[ENV_RESUME_FROM] = self.resume_from
        return env

    def new_report(self, started_at: float = 0.0) -> RunReport:
        """An empty report for a run of this plan."""
        return RunReport(
            world_size=self.world_size,
            backend=self.settings.backend,
            mixed_precision=self.settings.mixed_precision,
            start_method="in process" if self.in_process else self.start_method,
            started_at=started_at,
            main_rank=self.node_rank * self.local_world_size,
        )

    def worker_spec(self, port: int, attempt: int) -> WorkerSpec:
        """What every worker of attempt `attempt` runs, meeting its peers at `port`."""
        return WorkerSpec(
            function=self.function,
            args=self.args,
            kwargs=self.kwargs,
            node_rank=self.node_rank,
            local_world_size=self.local_world_size,
            environment=self.environment(port, attempt),
            threads_per_process=self.threads_per_process,
            return_all=self.return_all,
            # Picklable as they are, for workers started in fresh interpreters.
            worker_environment=functools.partial(
                self.platform.worker_environment, devices=self.devices
            ),
            run=self.platform.run_in_worker,
            # A fresh interpreter imports everything itself, whatever this process holds.
            report_imports=self.warm and self.start_method in ("fork", "forkserver"),
            start_method=self.start_method,
            post_mortem=self.post_mortem,
        )
