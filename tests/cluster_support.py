"""A real Ray cluster on this machine for the cluster tests, kept on the loopback interface.

`ray.cluster_utils.Cluster` starts a head node and more nodes as processes of
this machine, each a raylet of its own with its own resources, as on
separate machines; each node gets a directory of its own (NODE_DISK in its
processes' environment) standing for its own disk. Ray would advertise the
machine's network address; Ray's own setting for macOS and Windows keeps
every node (and the processes they start) on 127.0.0.1, so every byte of the
cluster's traffic stays on loopback (a test checks the connections). It must
be set before Ray is imported.

Each cluster keeps Ray's files (sessions, logs, sockets) in a directory of its own,
removed when it stops. A test that needs more nodes, GPUs or nodes it kills adds them
for a while (`LocalCluster.more_nodes`) and leaves the cluster as it found it.

What a test left on the cluster (agents, placement groups, worker processes,
CPUs held) is listed by `ours_still_running` and ended by `end_leftovers`;
tests/launch/cluster/conftest.py checks after every test that nothing is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from notebook_accel import release_cluster  # noqa: E402
from notebook_accel.launch import processes  # noqa: E402
from notebook_accel.launch.cluster.connect import (  # noqa: E402
    LOCAL_START_ATTEMPTS,
    descendant_pids,
    node_missed_registration,
)
from tests_support import PROMPTLY, suite_port  # noqa: E402

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
    """The running test cluster: its nodes, the directory standing for each one's disk, and
    the directory of Ray's own files (sessions, logs, sockets)."""

    cluster: Cluster
    directory: Path
    ray_dir: Path
    disks: dict[str, Path] = field(default_factory=dict)  # node id -> its disk
    disks_made: int = 0  # names each new disk apart from a removed node's (node0: the head's)

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
        self.disks_made += 1
        disk = self.directory / f"node{self.disks_made}"
        disk.mkdir()
        node = self.cluster.add_node(**{**NODE_ARGS, **args, "env_vars": {"NODE_DISK": str(disk)}})
        self.disks[node.node_id] = disk
        return node

    def remove_node(self, node, graceful: bool = False) -> None:
        """Kill the node's raylet and processes at once, as a machine that dies (`graceful`:
        let them leave the cluster first)."""
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.disks.pop(node.node_id, None)

    @contextmanager
    def more_nodes(self, count: int = 0, **args) -> Iterator[list[ray._private.node.Node]]:
        """`count` more nodes (of `args`) for the block. After it the cluster is as it was:
        the nodes added leave, a node of its own that the block lost (a test that kills one)
        is replaced by a fresh one, and Ray counts exactly these nodes alive again."""
        own = set(self.cluster.worker_nodes)
        added: list[ray._private.node.Node] = []
        try:
            for _ in range(count):
                added.append(self.add_node(**args))
            yield added
        finally:
            for node in added:
                if node in self.cluster.worker_nodes:
                    self.remove_node(node, graceful=True)
            for _ in own - self.cluster.worker_nodes:
                self.add_node()
            # A killed node counts as alive until its health checks have failed.
            self.cluster.wait_for_nodes(timeout=PROMPTLY)

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


def start_cluster(directory: Path, nodes: int = 2) -> LocalCluster:
    """A head and `nodes - 1` more nodes of 1 CPU each; this process connects as a driver.

    Every port the head listens on is one of the suite's (another Ray cluster on this
    machine holds Ray's defaults: 6379, the dashboard's 8265, its agent's 52365). Ray sees
    a lost node gone within seconds (FAST_HEALTH_CHECKS). A start that fails ends every
    process it started before the error is raised; one that failed only on Ray's fixed
    wait for a node to register (missed on a loaded machine) is made afresh once, as the
    launcher's own local start does (launch/cluster/connect.py).
    """
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            return _start_cluster(directory / f"start{attempt}", nodes)
        except Exception as error:
            if attempt == LOCAL_START_ATTEMPTS or not node_missed_registration(error):
                raise
    raise AssertionError("unreachable")


def _start_cluster(directory: Path, nodes: int) -> LocalCluster:
    running_before = descendant_pids()
    # Ray's unix sockets live under its directory, and a socket's path must fit in 107
    # bytes: a short directory of the cluster's own (pytest's tmp_path is too long).
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    head_disk = directory / "node0"
    head_disk.mkdir(parents=True)
    head_args = {
        **NODE_ARGS,
        "env_vars": {"NODE_DISK": str(head_disk)},
        "temp_dir": str(ray_dir),  # the other nodes and the drivers take the head's
        # Ray Client's server on the head, for drivers that connect with ray://; the
        # dashboard (Ray's state API reads through it) and the head's dashboard agent.
        "ray_client_server_port": suite_port(),
        "dashboard_port": suite_port(),
        "dashboard_agent_listen_port": suite_port(),
        "_system_config": FAST_HEALTH_CHECKS,
    }
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        local = LocalCluster(cluster, directory, ray_dir, {cluster.head_node.node_id: head_disk})
        for _ in range(nodes - 1):
            local.add_node()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    except BaseException:
        _end_a_failed_start(cluster, running_before, ray_dir)
        raise
    return local


def _end_a_failed_start(cluster: Cluster | None, running_before: set[int], ray_dir: Path) -> None:
    """Stop what a failed start left running: the nodes Ray knows of, then, by PID,
    every process this start made that is still there (a head that never registered
    is not in `cluster`: its gcs_server and log_monitor would run on for the session)."""
    with ExitStack() as steps:  # last to first, each even when one before it raised
        steps.callback(end_all_of, ray_dir, lambda: descendant_pids() - running_before)
        if cluster is not None:
            steps.callback(cluster.shutdown)
        steps.callback(ray.shutdown)


def end_processes(pids: set[int], seconds: float = 5.0) -> None:
    """SIGTERM to each of `pids` still running, SIGKILL to those left after `seconds`."""
    others = processes.OtherProcess.of(pids)
    processes.end_processes(others, grace=seconds, reap=seconds, groups=False)


def end_all_of(ray_dir: Path, others: Callable[[], set[int]] = set) -> None:
    """End by PID every process using `ray_dir` and every one of `others()`, again while
    more appear (a raylet still starts workers while it is stopped), then remove it."""
    deadline = time.monotonic() + PROMPTLY
    while (left := running(using(ray_dir) | others())) and time.monotonic() < deadline:
        end_processes(left)
    shutil.rmtree(ray_dir, ignore_errors=True)


def running(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (a zombie is over: only its parent can reap it)."""
    found = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.add(pid)
        except psutil.Error:
            continue
    return found


def using(ray_dir: Path) -> set[int]:
    """The processes of this machine that name `ray_dir` in their command line or hold a
    file of it open: every process of a cluster keeping its files there (those that set
    their own title, as ray::DashboardAgent, write their output into its logs), Ray's
    workers that outlived their raylet included. Not this process, Ray's driver, whose
    log there may still be open."""
    inside = str(ray_dir) + os.sep
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if process.pid == os.getpid():
            continue
        try:
            if any(str(ray_dir) in part for part in process.info["cmdline"] or ()) or any(
                file.path.startswith(inside) for file in process.open_files()
            ):
                found.add(process.pid)
        except psutil.Error:
            continue
    return found


def stop_cluster(local: LocalCluster) -> None:
    """Stop the cluster, each step even when one before it raised; then end by PID
    whatever process of it still runs, and remove Ray's directory of it."""
    known = []
    for pid in local.process_ids():
        try:
            known.append(psutil.Process(pid))
        except psutil.Error:
            pass

    def still_running() -> set[int]:
        # is_running() tells a process of the cluster from a new one that took its PID.
        return {p.pid for p in known if p.is_running()}

    with ExitStack() as steps:  # last to first, each even when one before it raised
        steps.callback(end_all_of, local.ray_dir, still_running)
        steps.callback(local.cluster.shutdown)
        steps.callback(ray.shutdown)
        steps.callback(release_cluster)


@dataclass
class Leftovers:
    """What a test left on the cluster."""

    actors: list = field(default_factory=list)  # Ray's ActorState of live agents and keepers
    groups: dict[str, str] = field(default_factory=dict)  # placement group ID -> state
    pids: set[int] = field(default_factory=set)  # processes of agents and keepers
    cpus_held: float = 0.0

    def described(self) -> list[str]:
        kinds = {"NodeAgent": "agent", "ClusterKeeper": "run keeper"}
        return [
            *(f"{kinds[a.class_name]} {a.actor_id[:8]} ({a.state})" for a in self.actors),
            *(f"placement group {group[:8]} ({state})" for group, state in self.groups.items()),
            *(f"process {pid} of an agent or a run keeper" for pid in sorted(self.pids)),
            *([f"{self.cpus_held:g} CPUs held"] if self.cpus_held else []),
        ]


def warm_pool():
    """The agents this process keeps warm after a run (`keep_warm`), or None."""
    from notebook_accel.launch.cluster import pool

    return pool._IDLE


def leftovers(local: LocalCluster, warm=None) -> Leftovers:
    """What is on the cluster, but for the warm pool `warm` (its agents, their processes,
    its placement group and the CPUs it holds)."""
    from ray.util.state import list_actors, list_placement_groups

    kept_actors = {agent._actor_id.hex() for agent in warm.agents} if warm else set()
    kept_group = warm.placement_group.id.hex() if warm else None
    left = Leftovers()
    kept_pids = set()
    for name in ("NodeAgent", "ClusterKeeper"):
        # The address, not Ray's guess: with two clusters on the machine it refuses to guess.
        actors = list_actors(address=local.address, filters=[("class_name", "=", name)])
        for actor in actors:
            if actor.actor_id in kept_actors:
                kept_pids.add(actor.pid)
            elif actor.state != "DEAD":
                left.actors.append(actor)
    left.groups = {
        group.placement_group_id: group.state
        for group in list_placement_groups(address=local.address)
        if group.state != "REMOVED" and group.placement_group_id != kept_group
    }
    for pid in local.process_ids() - kept_pids:
        try:
            command = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "NodeAgent" in command or "ClusterKeeper" in command:
            left.pids.add(pid)
    free, total = ray.available_resources(), ray.cluster_resources()
    kept_cpus = sum(bundle.get("CPU", 0) for bundle in warm.request.bundles()) if warm else 0
    left.cpus_held = total.get("CPU", 0) - free.get("CPU", 0) - kept_cpus
    return left


def ours_still_running(local: LocalCluster, warm=None) -> list[str]:
    """What a test left on the cluster: live agents and detached runs' keepers, placement
    groups, worker processes, CPUs held; those of the warm pool `warm` aside."""
    return leftovers(local, warm).described()


def end_leftovers(local: LocalCluster) -> None:
    """End what a test left on the cluster, so that the next test finds it free: each
    agent and keeper (a keeper by its name, as Ray kills actors only by handle, and every
    one's process by PID), each placement group by its ID."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    left = leftovers(local)
    for actor in left.actors:
        if actor.name:
            try:
                ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace))
            except ValueError:  # gone meanwhile
                pass
    end_processes({a.pid for a in left.actors if a.pid} | left.pids)
    for group in left.groups:
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group)))
        except Exception:  # noqa: BLE001 - removed meanwhile; the caller checks again
            pass


def wait_until_nothing_is_left(
    local: LocalCluster, seconds: float = GONE_SECONDS, warm=None
) -> list[str]:
    """What is still left after `seconds` (an empty list as soon as nothing is), the warm
    pool `warm` aside."""
    deadline = time.monotonic() + seconds
    while (left := ours_still_running(local, warm)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
