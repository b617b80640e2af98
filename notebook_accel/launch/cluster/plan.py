"""The checks a launch on a Ray cluster makes before anything starts, and its request.

Each error says what to do; the options of one machine alone were refused
before (launch/options.py).
"""

from __future__ import annotations

from typing import Any

from notebook_accel.launch.cluster.connect import alive_nodes, connect, require_ray
from notebook_accel.launch.cluster.request import ClusterRequest, NodeResources, amount, unmet
from notebook_accel.launch.errors import PlacementError
from notebook_accel.launch.packing import pack_for_cluster
from notebook_accel.platforms.base import Platform
from notebook_accel.platforms.hardware import Hardware
from notebook_accel.platforms.registry import platform_named


def place_on_cluster(
    values: dict[str, Any], function: Any, args: tuple, kwargs: dict
) -> tuple[Platform, ClusterRequest]:
    """The platform the workers run on and what to ask of the cluster, or an error."""
    _refuse_options_for_this_machine(values)
    require_ray()
    try:
        shipped = pack_for_cluster(function, args, kwargs)
    except Exception as error:  # noqa: BLE001 - whatever pickling raises, say it plainly
        raise TypeError(
            "the function and its arguments must travel to the cluster's nodes, but they "
            f"cannot be pickled ({type(error).__name__}: {error}). Pass plain data "
            "(tensors, numbers, strings, models) and define what the function uses in the "
            "notebook or in installed packages; open files, locks and connections cannot "
            "travel."
        ) from None
    connect(values["ray_address"])
    nodes = alive_nodes()
    platform = _platform(values["backend"], nodes)
    workers = values["num_processes"] or _default_workers(platform, nodes, values)
    per_node = values["workers_per_node"]
    if per_node and workers % per_node:
        raise ValueError(
            f"num_processes={workers} is not a multiple of workers_per_node={per_node}: "
            "every node used runs the same number of workers."
        )
    request = ClusterRequest(
        address=values["ray_address"],
        workers=workers,
        gpus_per_worker=1 if platform.name == "cuda" else 0,
        cpus_per_worker=values["cpus_per_worker"],
        strategy=values["placement_strategy"],
        workers_per_node=per_node,
        keep_warm=values["keep_warm"],
        shipped=shipped,
    )
    check_room(request, nodes)
    if platform.name == "cpu":  # a GPU's precisions are checked where it is
        hardware = Hardware(cpu_cores=int(sum(node.cpus for node in nodes)))
        platform.check_precision(values["mixed_precision"], hardware)
    return platform, request


def check_room(request: ClusterRequest, nodes: list[NodeResources]) -> None:
    """PlacementError when the cluster's `nodes` can never hold `request`."""
    if why := unmet(request, nodes):
        raise PlacementError(
            f"The cluster cannot run this launch: {why}. Nothing was started. Ask for fewer "
            "workers (num_processes), fewer CPUs each (cpus_per_worker), another "
            "placement_strategy, or add nodes."
        )


def _refuse_options_for_this_machine(values: dict[str, Any]) -> None:
    """Values that only this machine can honour (options of this machine alone are refused
    before: options.check_options_fit_place)."""
    if values["backend"] == "xla":
        raise ValueError(
            "backend='xla' runs on this machine's TPU only; on a Ray cluster the workers "
            "run on GPUs (backend='cuda') or CPUs (backend='cpu')."
        )
    if values["workers_per_node"] and values["placement_strategy"] != "PACK":
        raise ValueError(
            f"workers_per_node={values['workers_per_node']} puts that many workers on each "
            "node, every node its own (STRICT_SPREAD); leave placement_strategy unset."
        )


def _platform(backend: str | None, nodes: list[NodeResources]) -> Platform:
    gpus = sum(node.gpus for node in nodes)
    name = backend or ("cuda" if gpus else "cpu")
    if name == "cuda" and not gpus:
        raise PlacementError(
            f"backend='cuda' needs GPUs, but the cluster has none ({amount(len(nodes), 'node')}, "
            "CPUs only). Use backend='cpu', or add GPU nodes. Nothing was started."
        )
    return platform_named(name)


def _default_workers(platform: Platform, nodes: list[NodeResources], values: dict) -> int:
    """Every GPU of the cluster; on CPUs, one worker per node that has room, at least 2."""
    if platform.name == "cuda":
        return max(1, int(sum(node.gpus for node in nodes)))
    each = values["cpus_per_worker"]
    room = sum(node.slots(each, 0.0) for node in nodes)
    with_room = sum(1 for node in nodes if node.slots(each, 0.0) >= 1)
    return max(1, min(room, max(with_room, 2)))
