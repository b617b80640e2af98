"""Apply a function to every tensor inside nested lists, tuples and dicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def apply_to_tensors(
    fn: Callable[[torch.Tensor], Any], data: Any, *, strict: str | None = None
) -> Any:
    """Return `data` with `fn` applied to each tensor, keeping the container types.

    Lists, tuples (named tuples included) and mappings are rebuilt; anything
    else that is not a tensor is returned unchanged, or, when `strict` names
    the operation, refused with a TypeError (collectives need tensors).
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(apply_to_tensors(fn, item, strict=strict) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(fn, item, strict=strict) for item in data)
    if isinstance(data, Mapping):
        return type(data)(
            {key: apply_to_tensors(fn, value, strict=strict) for key, value in data.items()}
        )
    if strict is not None:
        raise TypeError(
            f"{strict} works on tensors in nested lists, tuples and dicts, and found a "
            f"{type(data).__name__}. Convert it to a tensor, or use gather_object for "
            "arbitrary picklable objects."
        )
    return data


def to_cpu(data: Any) -> Any:
    """Move every tensor in `data` to the CPU (detached), leaving the rest alone."""
    return apply_to_tensors(lambda t: t.detach().cpu(), data)
