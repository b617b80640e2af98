"""The agents of a launch on a Ray cluster: placed, ranked, kept warm, released.

A pool is one placement group holding what the launch asked for and one agent
per worker in it (launch/cluster/agent.py). Ranks follow the nodes: the workers
of the node that holds bundle 0 come first, each node's ranks are consecutive,
so LOCAL_RANK and LOCAL_WORLD_SIZE mean on a cluster what they mean on one machine.

After a run the pool stays up for `keep_warm` seconds, so the next launch with
the same shape reuses its agents (their processes, their imports) and starts in
a fraction of a second (live workers' `close()` releases theirs at once, unless
`start_workers` was given `keep_warm`). Releasing kills every agent and removes
the placement group, which frees its GPUs and CPUs for the cluster's other work.
The pool belongs to this kernel's Ray job, so Ray removes it if the kernel dies.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from notebook_accel.launch.cluster.agent import MAX_CONCURRENT_CALLS, AgentInfo, NodeAgent
from notebook_accel.launch.cluster.connect import alive_nodes, require_ray
from notebook_accel.launch.cluster.plan import check_room
from notebook_accel.launch.cluster.request import ClusterRequest, amount
from notebook_accel.launch.errors import PlacementError

# How long the cluster gets to find room for the placement group, when it has the room
# in all but other work holds part of it.
PLACEMENT_SECONDS = 30.0
# How long the agents get to start: Ray starts a process on each node that imports torch.
AGENT_START_SECONDS = 120.0
# The agents, and the workers they start, run at normal priority, not at the niceness 15
# Ray gives its worker processes: on a node shared with other work (a laptop's own
# cluster, a busy CI runner) a training run at nice 15 gets a few percent of a core. Ray
# Jobs runs a job's driver at 0 the same way (its job_manager sets this variable).
AGENT_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}
# How long warm agents get to answer before a launch makes new ones instead.
PING_SECONDS = 5.0
# After a node was lost, how long to wait for the cluster to see it gone before placing
# the workers again (until then Ray may still offer it).
NODE_GONE_SECONDS = 30.0
# The longest one wait lasts before the deadline and the stop signal are looked at again.
WAIT_SLICE_SECONDS = 0.1


@dataclass(frozen=True)
class Place:
    """Where one rank runs: its node (numbered in rank order) and its place on it."""

    rank: int
    node_index: int
    local_rank: int
    local_world_size: int
    first_rank: int
    info: AgentInfo
    # The GPUs of every rank on this node, in local-rank order (CUDA_VISIBLE_DEVICES):
    # cuda:LOCAL_RANK is then this rank's own GPU, as on one machine.
    node_gpu_ids: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"node {self.info.address} ({self.info.node_id[:8]})"


class WorkerPool:
    """A placement group and its agents, ordered by rank. Made by `create_pool`."""

    def __init__(
        self, request: ClusterRequest, group: Any, agents: list[Any], infos: list[AgentInfo]
    ) -> None:
        self.request = request
        self.placement_group = group
        self.places, order = _places(infos)
        self.agents = [agents[index] for index in order]
        self._released = False
        self._release = _releaser()  # made here: the keep-warm timer's thread imports nothing

    def answers(self) -> bool:
        """Whether every agent is up and answering (a warm pool is checked before use)."""
        ray = require_ray()
        try:
            ray.get([agent.ping.remote() for agent in self.agents], timeout=PING_SECONDS)
        except Exception:  # noqa: BLE001 - any failure means: make a new pool
            return False
        return True

    def release(self) -> None:
        """Kill every agent and remove the placement group (once; never raises)."""
        if not self._released:
            self._released = True
            self._release(self.placement_group, self.agents)


def create_pool(request: ClusterRequest, interrupt: Callable[[], bool] | None) -> WorkerPool:
    """Place `request` on the cluster and start its agents, or raise PlacementError
    (KeyboardInterrupt when `interrupt()` turns true meanwhile); nothing is left behind."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _wait_until_lost_nodes_are_gone(interrupt)
    check_room(request, alive_nodes(excluding=_LOST_NODES))
    group = placement_group(
        request.bundles(),
        strategy=request.placement_strategy,
        name=f"notebook_accel-{uuid.uuid4().hex[:12]}",
    )
    agents: list[Any] = []
    try:
        try:
            wait_for([group.ready()], PLACEMENT_SECONDS, interrupt)
        except TimeoutError:
            free = ray.available_resources()
            raise PlacementError(
                f"The cluster has room for {request.describe()} in all, but found none "
                f"within {PLACEMENT_SECONDS:.0f} s: other work holds part of it now (free "
                f"now: {amount(free.get('CPU', 0), 'CPU')}, {amount(free.get('GPU', 0), 'GPU')}; "
                "live workers of this kernel hold theirs until closed). Nothing was started; "
                "try again once it is free, or ask for fewer."
            ) from None
        placed = placement_group_table(group).get("bundles_to_node_id", {})
        actor = ray.remote(NodeAgent)
        for worker in range(request.workers):
            agents.append(
                actor.options(
                    num_cpus=request.cpus_per_worker,
                    num_gpus=request.gpus_per_worker,
                    max_concurrency=MAX_CONCURRENT_CALLS,
                    max_restarts=0,
                    max_task_retries=0,
                    runtime_env=AGENT_RUNTIME_ENV,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=request.bundle_of(worker)
                    ),
                ).remote()
            )
        try:
            infos = wait_for(
                [agent.describe.remote() for agent in agents], AGENT_START_SECONDS, interrupt
            )
        except TimeoutError:
            raise PlacementError(
                f"the workers' agents did not start within {AGENT_START_SECONDS:.0f} s on "
                f"the nodes Ray chose ({sorted(set(placed.values()))}); nothing was started."
            ) from None
        except ray.exceptions.RayActorError as error:
            text = str(error)
            lines = reversed(text.splitlines())
            detail = next((line.strip() for line in lines if "Error" in line), text[:300])
            raise PlacementError(
                f"the workers' agents could not start on the cluster ({detail}). Every node "
                "needs notebook_accel installed, with the torch this kernel uses (pip install "
                "notebook_accel on each node, or in the cluster's image); nothing was started."
            ) from None
    except BaseException:
        _releaser()(group, agents)
        raise
    return WorkerPool(request, group, agents, infos)


def wait_for(refs: list[Any], seconds: float, interrupt: Callable[[], bool] | None) -> list[Any]:
    """The values of `refs` once all are ready; TimeoutError after `seconds`, and
    KeyboardInterrupt as soon as `interrupt()` is true (looked at every 0.1 s)."""
    ray = require_ray()
    deadline = time.monotonic() + seconds
    pending = list(refs)
    while pending:
        if interrupt is not None and interrupt():
            raise KeyboardInterrupt("the run was stopped")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        _, pending = ray.wait(
            pending, num_returns=len(pending), timeout=min(WAIT_SLICE_SECONDS, remaining)
        )
    return ray.get(refs)


# -- keeping a pool warm between launches -----------------------------------------------

_LOCK = threading.Lock()
_IDLE: WorkerPool | None = None
_TIMER: threading.Timer | None = None
# Nodes lost by this kernel's runs: left out until Ray sees them gone.
_LOST_NODES: set[str] = set()


def take_pool(request: ClusterRequest, interrupt: Callable[[], bool] | None) -> WorkerPool:
    """A pool for `request`: the warm one when it has the same shape and answers, else
    a new one (the warm one is released first, to free what it holds)."""
    idle = _replace_idle()
    if idle is not None:
        if idle.request.shape == request.shape and idle.answers():
            idle.request = request
            return idle
        idle.release()
    return create_pool(request, interrupt)


def return_pool(pool: WorkerPool, keep: bool) -> None:
    """After a run: keep `pool` warm for its request's `keep_warm` seconds, or release
    it now (`keep` false: it was stopped, or it lost a node)."""
    if not keep or pool.request.keep_warm <= 0:
        pool.release()
        return
    timer = threading.Timer(pool.request.keep_warm, _release_if_idle, args=(pool,))
    timer.daemon = True
    previous = _replace_idle(pool, timer)
    if previous is not None and previous is not pool:
        previous.release()
    timer.start()


def release_idle() -> bool:
    """Release the warm pool now, if there is one; say whether there was."""
    idle = _replace_idle()
    if idle is not None:
        idle.release()
    return idle is not None


def node_lost(node_id: str) -> str:
    """A run lost `node_id`: place later runs elsewhere until Ray sees it gone. Returns
    why the worker there was lost (what the docs quote): Ray marks a node dead only after
    it missed its health checks for some seconds, so until then the kernel cannot tell a
    node gone from a network down."""
    with _LOCK:
        _LOST_NODES.add(node_id)
    if node_id not in {node.node_id for node in alive_nodes()}:
        return "its node left the cluster"
    return "its node stopped answering (it left the cluster, or the network to it is down)"


def _replace_idle(
    pool: WorkerPool | None = None, timer: threading.Timer | None = None
) -> WorkerPool | None:
    """Keep `pool` warm until `timer` releases it (None: no warm pool); return the one before."""
    global _IDLE, _TIMER
    with _LOCK:
        previous, _IDLE = _IDLE, pool
        if _TIMER is not None:
            _TIMER.cancel()
        _TIMER = timer
    return previous


def _release_if_idle(pool: WorkerPool) -> None:
    """The keep-warm timer ran out (on the timer's thread: only Ray calls, no imports)."""
    global _IDLE
    with _LOCK:
        if _IDLE is not pool:
            return
        _IDLE = None
    pool.release()


def _wait_until_lost_nodes_are_gone(interrupt: Callable[[], bool] | None) -> None:
    deadline = time.monotonic() + NODE_GONE_SECONDS
    while _LOST_NODES:  # a set's truth is read at once: no lock
        alive = {node.node_id for node in alive_nodes()}
        with _LOCK:
            _LOST_NODES.intersection_update(alive)
        if not _LOST_NODES or time.monotonic() >= deadline:
            return
        if interrupt is not None and interrupt():
            raise KeyboardInterrupt("the run was stopped")
        time.sleep(0.5)


# -- plumbing ------------------------------------------------------------------------


def _places(infos: list[AgentInfo]) -> tuple[list[Place], list[int]]:
    """Each rank's place, and which agent (by creation order) runs each rank."""
    nodes = list(dict.fromkeys(info.node_id for info in infos))
    order = sorted(range(len(infos)), key=lambda i: (nodes.index(infos[i].node_id), i))
    places: list[Place] = []
    for rank, index in enumerate(order):
        info = infos[index]
        same_node = [i for i in order if infos[i].node_id == info.node_id]
        first = order.index(same_node[0])
        places.append(
            Place(
                rank=rank,
                node_index=nodes.index(info.node_id),
                local_rank=rank - first,
                local_world_size=len(same_node),
                first_rank=first,
                info=info,
                node_gpu_ids=tuple(gpu for i in same_node for gpu in infos[i].gpu_ids),
            )
        )
    return places, order


def _releaser() -> Callable[[Any, list[Any]], None]:
    """What kills agents and removes their placement group (a part already gone is fine),
    with Ray's functions looked up now."""
    ray = require_ray()
    from ray.util.placement_group import remove_placement_group

    def release(group: Any, agents: list[Any]) -> None:
        for agent in agents:
            with contextlib.suppress(Exception):  # a lost node's agent is gone already
                ray.kill(agent, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(group)

    return release
