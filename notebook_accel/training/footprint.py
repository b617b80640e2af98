"""What a training process holds in memory: parameters, gradients, optimizer state.

`training_footprint` counts the bytes this process holds of each (its own
shards for a model sharded with FSDP: a DTensor counts its local part) and how
many of them sit on the training device rather than in host memory (CPU
offload moves them there). Counted between steps: tensors FSDP gathers for a
forward or backward and frees again, DDP's gradient buckets, activations and
allocator caches are not included.

`footprint_table` lays several footprints out as a Markdown table with each
one's total as a ratio of a reference row (DDP, usually).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MemoryFootprint:
    """Bytes one process holds for training (see `training_footprint`)."""

    parameters: int
    gradients: int
    optimizer_state: int
    on_device: int  # of the total, the bytes on the training device (not host memory)

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.parameters + self.gradients + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        """The fields and the total."""
        return {**asdict(self), "total": self.total}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> tuple[int, int]:
    """(bytes, bytes on `device`) of the distinct tensors."""
    seen: set[int] = set()
    total = on_device = 0
    for tensor in tensors:
        # By the tensor the model or optimizer holds (alive, so its id is its own);
        # `to_local()` makes a new object at every call.
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = _local(tensor)
        size = local.numel() * local.element_size()
        total += size
        if local.device.type == device.type:
            on_device += size
    return total, on_device


def _state_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step counters
                yield value


def training_footprint(
    model: torch.nn.Module,
    optimizer: Any = None,
    device: torch.device | str | None = None,
) -> MemoryFootprint:
    """The bytes this process holds of `model`'s parameters and gradients and `optimizer`'s state.

    `device`: the training device (default: this process's, `PartialState().device`);
    bytes on it are counted in `on_device`. On a machine without an accelerator
    the device is the CPU, so everything counts as on the device, offloaded or
    not. Call between steps, after `optimizer.step()` and before `zero_grad()`,
    to count the gradients too.
    """
    parameters = list(model.parameters())
    if device is None:
        from notebook_accel.training.state import PartialState

        device = PartialState().device
    device = torch.device(device)
    params, params_on = _bytes(parameters, device)
    grads, grads_on = _bytes((p.grad for p in parameters if p.grad is not None), device)
    state, state_on = _bytes(_state_tensors(optimizer) if optimizer is not None else (), device)
    return MemoryFootprint(params, grads, state, params_on + grads_on + state_on)


def footprint_table(rows: Mapping[str, MemoryFootprint], reference: str) -> str:
    """A Markdown table of `rows` (name -> footprint), totals as ratios of `rows[reference]`."""
    base = rows[reference].total or 1
    lines = [
        "| run | parameters | gradients | optimizer state | total | on device | vs "
        + reference
        + " |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row.parameters:,} | {row.gradients:,} | {row.optimizer_state:,} "
            f"| {row.total:,} | {row.on_device:,} | {row.total / base:.3f}x |"
        )
    return "\n".join(lines)
