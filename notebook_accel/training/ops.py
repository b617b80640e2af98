"""Collectives on nested structures of tensors: gather, reduce, pad, broadcast.

Every function is a no-op (or a copy) in a single process, so training code
runs unchanged with one process or many. The primitive collectives come from
the platform's `Collectives` (platforms/collectives.py: torch.distributed's
gloo and nccl, or XLA's own), which the process state installs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from notebook_accel.platforms.collectives import Collectives
from notebook_accel.training.nested import apply_to_tensors

REDUCTIONS = ("sum", "mean", "max")


_collectives: Collectives = Collectives()
_check_shapes = False


class DistributedOperationException(Exception):
    """A collective was called with tensors whose shapes differ across processes
    (raised instead of hanging or mixing data, when shape checking is on)."""


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor, which has no one size to pad to: it is
    returned as it is."""


def check_shapes(on: bool) -> None:
    """Turn shape checking before collectives on or off (`PartialState().debug = True`)."""
    global _check_shapes
    _check_shapes = on


def checking_shapes() -> bool:
    """Whether collectives check the shapes across processes first."""
    return _check_shapes


def _verify(data: Any, operation: str, ignore_dim: int | None = None) -> None:
    """Raise DistributedOperationException on every process when shapes disagree.

    The shapes travel as objects, so a mismatch is reported rather than left to
    a tensor collective, which could hang or read garbage.
    """
    if not _check_shapes or world_size() == 1:
        return
    shapes: list[tuple] = []
    # a nested tensor has no single shape: padding leaves it alone, a gather refuses it
    apply_to_tensors(lambda t: None if t.is_nested else shapes.append(tuple(t.shape)), data)
    everyone = _collectives.all_gather_object(shapes)

    def comparable(shape: tuple) -> tuple:
        if ignore_dim is None or not -len(shape) <= ignore_dim < len(shape):
            return shape
        return (len(shape), *(s for i, s in enumerate(shape) if i != ignore_dim % len(shape)))

    if len({tuple(comparable(shape) for shape in item) for item in everyone}) > 1:
        listing = "; ".join(f"process {rank}: {item}" for rank, item in enumerate(everyone))
        raise DistributedOperationException(
            f"{operation} needs tensors of matching shapes on every process, got {listing}."
        )


def use_collectives(collectives: Collectives) -> Collectives:
    """Route the functions below through `collectives` (the process state's platform
    picks them); returns the previous ones, so a caller can put them back."""
    global _collectives
    previous, _collectives = _collectives, collectives
    return previous


def world_size() -> int:
    """Number of processes taking part (1 when there is no group)."""
    return _collectives.world_size()


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    return _collectives.all_gather(tensor.contiguous())


def gather(data: Any) -> Any:
    """Concatenate each tensor of `data` across processes along dim 0, in rank order.

    Every process must pass tensors of the same shape (use `pad_across_processes`
    first when they differ); 0-d tensors become one element per process.
    """
    if world_size() == 1:
        return apply_to_tensors(lambda t: t if t.ndim else t[None], data, strict="gather")
    _verify(data, "gather", ignore_dim=0)
    return apply_to_tensors(_gather_one, data, strict="gather")


def gather_object(obj: Any) -> list:
    """Gather a picklable object from every process, as a list in rank order.

    Lists and tuples are concatenated (so per-batch lists of strings become one
    list); any other object becomes one list item per process.
    """
    n = world_size()
    if n == 1:
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    gathered = _collectives.all_gather_object(obj)
    if all(isinstance(item, (list, tuple)) for item in gathered):
        return [x for item in gathered for x in item]
    return gathered


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum, average or max each tensor of `data` across processes (a new tensor), times `scale`."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; choose one of {', '.join(REDUCTIONS)}.")
    n = world_size()
    _verify(data, "reduce")

    def reduce_one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if n > 1:
            out = _collectives.all_reduce(out, reduction)
        if reduction == "mean":
            out /= n
        if scale != 1.0:
            out *= scale
        return out

    return apply_to_tensors(reduce_one, data, strict="reduce")


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor of `data` along `dim` to the largest size any process has.

    Padding is filled with `pad_index` and goes at the end (or the start with
    `pad_first=True`), so the results can then be gathered.
    """
    n = world_size()
    _verify(data, "pad_across_processes", ignore_dim=dim)

    def pad_one(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_nested:
            warnings.warn(
                "pad_across_processes leaves a nested tensor as it is: its rows have sizes "
                "of their own. Pad it with torch.nested.to_padded_tensor first to gather it.",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return tensor
        if n == 1 or tensor.ndim == 0 or not -tensor.ndim <= dim < tensor.ndim:
            return tensor
        axis = dim % tensor.ndim
        sizes = _gather_one(torch.tensor([tensor.shape[axis]], device=tensor.device))
        longest = int(sizes.max())
        if longest == tensor.shape[axis]:
            return tensor
        shape = list(tensor.shape)
        shape[axis] = longest
        # `+` rather than new_full: pad_index may be a row to repeat, not just a number.
        out = (tensor.new_zeros(shape) + pad_index).to(tensor.dtype)
        start = longest - tensor.shape[axis] if pad_first else 0
        out.narrow(axis, start, tensor.shape[axis]).copy_(tensor)
        return out

    return apply_to_tensors(pad_one, data, strict="pad_across_processes")


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Overwrite each tensor of `data` with its value on `from_process`; returns `data`."""
    if world_size() == 1:
        return data
    _verify(data, "broadcast")

    def broadcast_one(tensor: torch.Tensor) -> torch.Tensor:
        moved = _collectives.broadcast(tensor, from_process)
        if moved is not tensor:
            tensor.copy_(moved)
        return tensor

    return apply_to_tensors(broadcast_one, data, strict="broadcast")


def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    """Replace the items of `objects` in place with those on `from_process`; returns the list."""
    if world_size() > 1:
        _collectives.broadcast_object_list(objects, from_process)
    return objects


def sync_generator(generator: torch.Generator, from_process: int = 0) -> None:
    """Give `generator` the state it has on `from_process`, so every process draws alike."""
    if world_size() > 1:
        state = generator.get_state()
        broadcast(state, from_process)
        generator.set_state(state)
