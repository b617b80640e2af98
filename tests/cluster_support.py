"""A real Ray cluster on this machine for the cluster tests, kept on the loopback interface.

`ray.cluster_utils.Cluster` starts a head node and more nodes as processes of
this machine, each a raylet of its own with its own resources, as on
separate machines; each node gets a directory of its own (NODE_DISK in its
processes' environment) standing for its own disk. Ray would advertise the
machine's network address; Ray's own setting for macOS and Windows keeps
every node (and the processes they start) on 127.0.0.1, so every byte of the
cluster's traffic stays on loopback (a test checks the connections). It must
be set before Ray is imported.

What a test left on the cluster (agents, placement groups, worker processes,
CPUs held) is listed by `ours_still_running`; tests/launch/cluster/conftest.py
checks after every test that nothing is.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from notebook_accel import release_cluster  # noqa: E402
from notebook_accel.launch.cluster.connect import descendant_pids, end_processes  # noqa: E402
from tests_support import PROMPTLY, free_port  # noqa: E402

# Small nodes, as the machines of a real cluster would be for these tiny models.
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
# Ray sees a lost node gone in about five seconds (by default in about fifteen); a node
# of a busy machine still answers in time (checks that missed 3 half-second answers in a
# row marked a live node dead here).
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}
# How long a test's agents and placement group get to go once it ends.
GONE_SECONDS = PROMPTLY


@dataclass
class LocalCluster:
    """The running test cluster: its nodes and the directory standing for each one's disk."""

    cluster: Cluster
    directory: Path
    disks: dict[str, Path] = field(default_factory=dict)  # node id -> its disk

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def client_address(self) -> str:
        """The head's Ray Client server: ray://127.0.0.1:PORT."""
        return f"ray://127.0.0.1:{self.cluster.head_node._ray_params.ray_client_server_port}"

    @property
    def head_disk(self) -> Path:
        return self.disks[self.cluster.head_node.node_id]

    def add_node(self, **args) -> ray._private.node.Node:
        """Another node of 1 CPU, with a disk of its own."""
        disk = self.directory / f"node{len(self.disks)}"
        disk.mkdir()
        node = self.cluster.add_node(**{**NODE_ARGS, **args, "env_vars": {"NODE_DISK": str(disk)}})
        self.disks[node.node_id] = disk
        return node

    def remove_node(self, node) -> None:
        """Kill the node's raylet and processes at once, as a machine that dies."""
        self.cluster.remove_node(node, allow_graceful=False)

    def node_holding(self, disk: str):
        """The node whose disk is `disk` (what a worker's NODE_DISK says)."""
        for node in self.cluster.worker_nodes:
            if str(self.disks.get(node.node_id)) == disk:
                return node
        raise LookupError(f"no worker node has the disk {disk}")

    def process_ids(self) -> set[int]:
        """Every process of the cluster: its nodes' processes and what they started."""
        found: set[int] = set()
        for node in [self.cluster.head_node, *self.cluster.worker_nodes]:
            if node is None:
                continue
            for infos in node.all_processes.values():
                for info in infos:
                    found.add(info.process.pid)
                    try:
                        found.update(c.pid for c in psutil.Process(info.process.pid).children(True))
                    except psutil.Error:
                        pass
        return found


def start_cluster(
    directory: Path,
    nodes: int = 2,
    fast_health_checks: bool = False,
    node_args: dict | None = None,
    head_cpus: int = 1,
) -> LocalCluster:
    """A head of `head_cpus` CPUs and `nodes - 1` more nodes of 1 CPU each (or
    `node_args`); this process connects as a driver.

    Every port the head listens on is a free one of its own (another Ray cluster on
    this machine holds Ray's defaults: 6379, the dashboard's 8265, its agent's 52365).
    A start that fails ends every process it started before the error is raised.
    """
    running_before = descendant_pids()
    head_disk = directory / "node0"
    head_disk.mkdir(parents=True)
    head_args = {
        **NODE_ARGS,
        "num_cpus": head_cpus,
        "env_vars": {"NODE_DISK": str(head_disk)},
        # Ray Client's server on the head, for drivers that connect with ray://; the
        # dashboard (Ray's state API reads through it) and the head's dashboard agent.
        "ray_client_server_port": free_port(),
        "dashboard_port": free_port(),
        "dashboard_agent_listen_port": free_port(),
    }
    if fast_health_checks:
        head_args["_system_config"] = FAST_HEALTH_CHECKS
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        local = LocalCluster(cluster, directory, {cluster.head_node.node_id: head_disk})
        for _ in range(nodes - 1):
            local.add_node(**(node_args or {}))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        _end_a_failed_start(cluster, running_before)
        raise
    return local


def _end_a_failed_start(cluster: Cluster | None, running_before: set[int]) -> None:
    """Stop what a failed start left running: the nodes Ray knows of, then, by PID,
    every process this start made that is still there (a head that never registered
    is not in `cluster`: its gcs_server and log_monitor would run on for the session)."""
    ray.shutdown()
    if cluster is not None:
        try:
            cluster.shutdown()
        except Exception:  # noqa: BLE001 - the processes are ended below either way
            pass
    end_processes(descendant_pids() - running_before)


def stop_cluster(local: LocalCluster) -> None:
    release_cluster()
    ray.shutdown()
    local.cluster.shutdown()


def ours_still_running(local: LocalCluster) -> list[str]:
    """What a test left on the cluster: live agents and detached runs' keepers, placement
    groups, worker processes."""
    from ray.util.state import list_actors, list_placement_groups

    left = []
    for kind, name in (("agent", "NodeAgent"), ("run keeper", "ClusterKeeper")):
        # The address, not Ray's guess: with two clusters on the machine it refuses to guess.
        actors = list_actors(address=local.address, filters=[("class_name", "=", name)])
        left += [f"{kind} {a.actor_id[:8]} ({a.state})" for a in actors if a.state != "DEAD"]
    left += [
        f"placement group {group.placement_group_id[:8]} ({group.state})"
        for group in list_placement_groups(address=local.address)
        if group.state != "REMOVED"
    ]
    for pid in local.process_ids():
        try:
            command = " ".join(psutil.Process(pid).cmdline())
            if "NodeAgent" in command or "ClusterKeeper" in command:
                left.append(f"process {pid} of an agent or a run keeper")
        except psutil.Error:
            continue
    free, total = ray.available_resources(), ray.cluster_resources()
    if free.get("CPU") != total.get("CPU"):
        left.append(f"{total.get('CPU', 0) - free.get('CPU', 0):g} CPUs held")
    return left


def wait_until_nothing_is_left(local: LocalCluster, seconds: float = GONE_SECONDS) -> list[str]:
    """What is still left after `seconds` (an empty list as soon as nothing is)."""
    deadline = time.monotonic() + seconds
    while (left := ours_still_running(local)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
