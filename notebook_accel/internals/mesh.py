"""DeviceMesh flattening: torch's only way to name a group of mesh dimensions as one
(ParallelismConfig's dp_shard x cp dimension, which FSDP2 shards over; Accelerate
uses it too). Still private in torch 2.14."""

from __future__ import annotations

from typing import Any

from notebook_accel.internals.api import PrivateApi, has, missing_error


def flatten(mesh: Any, name: str) -> Any:
    """The 1-D mesh `name` made of every dimension of `mesh` (a slice of a whole mesh)."""
    if not hasattr(mesh, "_flatten"):
        raise missing_error("DeviceMesh._flatten", f"ParallelismConfig's {name} dimension")
    return mesh._flatten(name)


def require_flatten(needed_for: str) -> None:
    """Raise TorchInternalMissing, before anything starts, where this torch's DeviceMesh
    cannot flatten."""
    if not _present():
        raise missing_error("DeviceMesh._flatten", needed_for)


def _present() -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return has(DeviceMesh, "_flatten")


APIS = [
    PrivateApi(
        "DeviceMesh._flatten",
        "ParallelismConfig layouts that shard over dp_shard x cp",
        "such a layout is refused before anything starts",
        _present,
    )
]
