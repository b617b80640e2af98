"""The primitive collectives a platform gives its processes.

`Collectives` runs them over torch.distributed's default group (gloo, nccl),
reading the world from the process group the `Accelerator` initialised; a
platform may subclass it (platforms/xla.py). The collectives over nested
structures of tensors (training/ops.py) are built on these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Collectives:
    """The primitive collectives over torch.distributed's default group.

    `staging` gives the device that tensors on other devices go through (nccl
    moves only CUDA tensors: a generator state or a number made into a tensor
    makes the round trip through the current GPU); None: every device works.
    """

    def __init__(self, staging: Callable[[], torch.device | None] | None = None) -> None:
        self._staging = staging

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor` (at least 1-d, same shape), concatenated along dim 0."""
        return self._on_comm_device(self._all_gather, tensor)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size())]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=0)

    def all_reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        """`tensor` summed ("sum") or maxed ("max") over the processes, in place."""
        op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
        return self._on_comm_device(lambda t: (dist.all_reduce(t, op), t)[1], tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s values of `tensor` (the result may be a copy on another device)."""
        return self._on_comm_device(lambda t: (dist.broadcast(t, src=src), t)[1], tensor)

    def _on_comm_device(
        self, op: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor
    ) -> torch.Tensor:
        """Run `op` where the backend can talk, and come back to the input's device."""
        staging = self._staging() if self._staging and self.world_size() > 1 else None
        if staging is None or tensor.device.type == staging.type:
            return op(tensor)
        return op(tensor.to(staging)).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list:
        gathered: list[Any] = [None] * self.world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object_list(self, objects: list, src: int) -> None:
        dist.broadcast_object_list(objects, src=src)
