"""DeviceMesh flattening: torch's only way to name a group of mesh dimensions as one
(ParallelismConfig's "dp", "dp_shard_cp" and "dp_cp", as Accelerate names them).
Still private in torch 2.14.

Each is flattened from a slice of the whole mesh's own dimensions, which works alike on
every torch of the tested range, and can then be sliced from the whole mesh by its name
(`mesh["dp"]`, as notebooks written for Accelerate do). Slicing a flattened name is what
changed: from torch 2.9.1 a slice mixing it with other dimensions can fail
(pytorch/pytorch#169381), and torch 2.13 and 2.14 warn that slicing it from the whole
mesh will go. So the package keeps the meshes `flatten` returns and uses those."""

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
        "ParallelismConfig's flattened dimensions (dp, dp_shard_cp, dp_cp)",
        "a layout with data or context parallelism is refused before anything starts",
        _present,
    )
]
