"""Every private torch API the package uses, one module per concern.

torch keeps no promise about a name that starts with an underscore; these are the
ones the package cannot do without (or would do worse without), each used only
through the module of its concern:

- `ddp`: DistributedDataParallel's reducer and process group (moving a live
  worker's model to a group formed again; the gradient-bucket layout kept across
  a resume).
- `c10d`: the default process group's store and timeout (forming a group again).
- `mesh`: DeviceMesh flattening (ParallelismConfig's dp, dp_shard_cp and dp_cp
  dimensions).
- `context_parallel`: how context parallelism passes keys and values (cp_comm_strategy).
- `cuda`: CUDA's lazy start and its NVML count (keeping the kernel fork-safe).
- `dynamo`: torch.compile's wrapper and its recompile limit.
- `tensors`: `Module.to`'s argument parser and pytree's typed map.

Each checks that the running torch has what it needs where it is used: where it
does not, it takes a public path, or raises `TorchInternalMissing`, which names the
API, what needs it and the torch releases it is tested on. `missing()` lists what the
running torch lacks (`notebook-accel env` reports it); tests/test_torch_internals.py
checks each on every torch of the tested range. `tested_range` holds that range.

May import: nothing of the package (the lowest layer: torch only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from notebook_accel._lazy import lazy_exports

# public name -> module that defines it (imported on first use: see _lazy.py)
_EXPORTS = {
    "PrivateApi": "notebook_accel.internals.api",
    "TorchInternalMissing": "notebook_accel.internals.api",
}

if TYPE_CHECKING:
    from notebook_accel.internals.api import PrivateApi, TorchInternalMissing

__all__ = ["PrivateApi", "TorchInternalMissing", "all_apis", "missing"]


def all_apis() -> list[PrivateApi]:
    """Every private API of every concern."""
    from notebook_accel.internals import c10d, context_parallel, cuda, ddp, dynamo, mesh, tensors

    concerns = (ddp, c10d, mesh, context_parallel, cuda, dynamo, tensors)
    return [api for module in concerns for api in module.APIS]


def missing() -> list[PrivateApi]:
    """The private APIs the running torch lacks (none on a tested torch)."""
    return [api for api in all_apis() if not _present(api)]


def _present(api: PrivateApi) -> bool:
    try:
        return bool(api.present())
    except Exception:  # noqa: BLE001 - an import or attribute that fails is a missing API
        return False


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
