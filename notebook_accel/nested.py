"""Apply a function to every tensor inside nested lists, tuples and dicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return `data` with `fn` applied to each tensor, keeping the container types.

    Lists, tuples (named tuples included) and mappings are rebuilt; anything
    else that is not a tensor is returned unchanged.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(apply_to_tensors(fn, item) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(fn, item) for item in data)
    if isinstance(data, Mapping):
        return type(data)({key: apply_to_tensors(fn, value) for key, value in data.items()})
    return data


def to_cpu(data: Any) -> Any:
    """Move every tensor in `data` to the CPU (detached), leaving the rest alone."""
    return apply_to_tensors(lambda t: t.detach().cpu(), data)
