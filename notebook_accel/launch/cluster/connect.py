"""Reaching Ray from the kernel: the package, the connection, what the cluster has.

The kernel is a Ray driver. It uses the connection it has (`ray.init` called
in an earlier cell, or by an earlier launch), else the cluster `ray_address`
names ("auto" for the one `ray start` runs on this machine, "host:6379",
"ray://host:10001" through Ray Client), else $RAY_ADDRESS, else it starts a
Ray cluster of this machine alone, bound to the loopback interface.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Any

from notebook_accel.launch import processes
from notebook_accel.launch.cluster.request import NodeResources
from notebook_accel.launch.options import host_and_port

INSTALL = 'pip install "notebook_accel[ray]"'
# How long the kernel tries to reach the cluster's address before saying it cannot.
REACH_SECONDS = 5.0
# Ray's setting that keeps a cluster on the loopback interface, as it does on macOS
# and Windows; Ray reads it when it is imported.
LOOPBACK_SETTING = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Starts of the kernel's own cluster before giving up: a node that missed Ray's fixed
# registration wait on a busy machine is started afresh once.
LOCAL_START_ATTEMPTS = 2


def require_ray() -> Any:
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ModuleNotFoundError(
            f"cluster='ray' runs the workers on a Ray cluster, but the ray package is not "
            f"installed here: {INSTALL} (or pip install 'ray[default]'), then run the "
            "cell again."
        ) from None
    return ray


def connect(address: str | None) -> str:
    """Make sure this process is connected to the cluster; return what it is connected to.

    Raises ConnectionError, saying what to do, when the address cannot be reached.
    """
    global _CONNECTED_WITH
    ray = require_ray()
    if ray.is_initialized():
        current = _current_address(ray)
        if not _connected_to(address, current, ray):
            raise ConnectionError(
                f"this kernel is connected to the Ray cluster at {current}, not {address}: "
                "call ray.shutdown() first to connect elsewhere, or leave ray_address "
                "unset to use that cluster."
            )
        return f"the Ray cluster at {current}" if current else "the Ray cluster"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        _start_local(ray)
        _CONNECTED_WITH = None
        return "a Ray cluster of this machine alone"
    _check_reachable(address)
    try:
        _init(ray, address)
    except ConnectionError as error:
        if CLIENT_SERVER_FAILED in str(error):
            raise ConnectionError(
                f"cannot connect to the Ray cluster at {address!r}: its Ray Client server "
                f"failed to start this kernel's side {CLIENT_ATTEMPTS} times in a row "
                "(ray-project/ray#63202: the process it starts for each new driver can die or "
                "hang as it starts, more often on a busy head). Run the cell again, or from "
                "a machine inside the cluster's network connect to the head's own address "
                f"(host:6379) instead. Ray said: {str(error).splitlines()[0]}"
            ) from None
        raise ConnectionError(
            f"cannot connect to the Ray cluster at {address!r} ({error}). Start one with "
            "`ray start --head`, pass its address as ray_address, or leave ray_address "
            "unset to start one on this machine."
        ) from None
    _CONNECTED_WITH = address
    return f"the Ray cluster at {address}"


# Ray Client's server on the head starts a process for each driver that connects, and
# that process dies now and then as it is forked (ray-project/ray#63202: about 7% of
# connections); the connection then fails with "Initialization failure from server".
# Each new attempt gets a new process.
CLIENT_ATTEMPTS = 3
CLIENT_SERVER_FAILED = "Initialization failure from server"


def _init(ray: Any, address: str) -> None:
    """ray.init at `address`, again when Ray Client's server failed to start its side."""
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=address, log_to_driver=False, logging_level="warning")
            return
        except ConnectionAbortedError as error:
            # A failed Ray Client connection is disconnected before it raises.
            if CLIENT_SERVER_FAILED not in str(error) or attempt == CLIENT_ATTEMPTS:
                raise


# The address this process connected with here (Ray Client does not say it back).
_CONNECTED_WITH: str | None = None


def _connected_to(address: str | None, current: str, ray: Any) -> bool:
    """Whether this process's Ray connection is the one `address` asks for."""
    if address in (None, "auto") or address == _CONNECTED_WITH:
        return True
    if address.startswith("ray://"):
        # Through Ray Client the connection knows the cluster's own address, not the
        # client server's: any client connection is taken for the one asked for.
        return ray.util.client.ray.is_connected()
    return not current or _same(address, current)


def alive_nodes(excluding: set[str] | frozenset[str] = frozenset()) -> list[NodeResources]:
    """The cluster's live nodes and the CPUs and GPUs each has (in all, not free)."""
    return [
        NodeResources(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", "?"),
            cpus=float(node.get("Resources", {}).get("CPU", 0.0)),
            gpus=float(node.get("Resources", {}).get("GPU", 0.0)),
        )
        for node in require_ray().nodes()
        if node.get("Alive") and node["NodeID"] not in excluding
    ]


def _start_local(ray: Any) -> None:
    """A Ray cluster of this machine alone, for this kernel (it ends with the kernel).

    Only this machine takes part, so Ray stays on the loopback interface (it would
    otherwise advertise the machine's network address): the setting is read when
    Ray is imported, and by the processes Ray starts."""
    os.environ.setdefault(LOOPBACK_SETTING, "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ[LOOPBACK_SETTING] == "0":
        constants.ENABLE_RAY_CLUSTER = False  # ray was imported before the setting
    # At least 2 CPUs: a launch's default is 2 CPU workers, on one core too (they share it).
    cpus = max(2, os.cpu_count() or 1)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        running_before = descendant_pids()
        try:
            # "local": a new cluster of this kernel's own, even where another runs on
            # this machine (without it, ray.init joins the one `ray start` left its
            # address for).
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="warning",
            )
            return
        except Exception as error:
            # A head whose node never registered is not known to ray.shutdown(): its
            # processes (this process's children) are ended by PID.
            with contextlib.suppress(Exception):
                ray.shutdown()
            end_new_descendants(running_before)
            if attempt < LOCAL_START_ATTEMPTS and node_missed_registration(error):
                continue  # a fresh start, the first one's processes all ended
            said = " ".join(line.strip() for line in str(error).splitlines()[:3] if line.strip())
            tried = "" if attempt == 1 else f" ({attempt} tries)"
            raise RuntimeError(
                "cluster='ray' without ray_address starts a Ray cluster of this machine "
                f"alone, and it did not start{tried} (Ray said: "
                f"{said or type(error).__name__}). Everything it had started was stopped. "
                "Ray gives its processes fixed times to start (its node 30 s, and its "
                "dashboard agent 15 s, or the node's raylet exits: ray-project/ray#65983), "
                "which a busy machine can miss: run the cell again once the load eases. To "
                "use a Ray cluster already running on this machine, pass ray_address='auto'."
            ) from error


def node_missed_registration(error: Exception) -> bool:
    """Ray's start failed only on its fixed 30 s wait for the node to register
    (ray/_private/node.py: not a setting), which a busy machine can miss. It is also
    what Ray says when the node's raylet exited because the dashboard agent had not
    written its port files within 15 s (ray-project/ray#65983; pinning the agent's ports
    does not skip that wait, Ray 2.60)."""
    return "timed out during startup" in str(error)


def descendant_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def end_new_descendants(running_before: set[int]) -> None:
    """End every descendant of this process not in `running_before`, and all they start
    meanwhile. Each is stopped (SIGSTOP) before any is ended, until no new one appears: a
    raylet ended while it starts its agents would leave them running, no longer this
    process's descendants, out of reach (ray::DashboardAgent, ray::RuntimeEnvAgent)."""
    import psutil

    seen = set(running_before)
    stopped: list[processes.OtherProcess] = []
    while new := descendant_pids() - seen:
        seen |= new
        for pid in new:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                process.suspend()
                stopped.append(processes.OtherProcess(process))
    # Stopped processes act on SIGKILL alone; what a failed start leaves has nothing to save.
    processes.end_processes(stopped, grace=0, reap=5.0, groups=False)


def _check_reachable(address: str) -> None:
    if address == "auto":
        return  # Ray finds the cluster of this machine itself, or says there is none
    where = host_and_port(address)
    if where is None:
        raise ValueError(
            f"ray_address={address!r} must be 'auto', 'host:port' (the head's GCS, port "
            "6379 by default) or 'ray://host:port' (Ray Client, port 10001 by default)."
        )
    try:
        socket.create_connection(where, timeout=REACH_SECONDS).close()
    except OSError as error:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address!r} ({error.strerror or error}); "
            "check the address and that the cluster runs (`ray status` on its head node), "
            "or leave ray_address unset to start a cluster on this machine. Nothing was "
            "started."
        ) from None


def _current_address(ray: Any) -> str:
    try:
        return str(ray.get_runtime_context().gcs_address or "")
    except Exception:  # noqa: BLE001 - a Ray Client connection does not say
        return ""


def _same(address: str, current: str) -> bool:
    asked, connected = host_and_port(address), host_and_port(current)
    if asked is None or connected is None:
        return address == current
    return asked[1] == connected[1] and _resolve(asked[0]) == _resolve(connected[0])


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
