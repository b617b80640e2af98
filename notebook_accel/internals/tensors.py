"""`Module.to`'s argument parser (torch._C._nn._parse_to), to tell whether a call moves
a model to another device, and pytree's typed map (torch.utils._pytree.tree_map_only),
for the FSDP2 optimizer state: torch's own, used by its state-dict code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from notebook_accel.internals.api import PrivateApi, has, missing_error


def to_device(*args: Any, **kwargs: Any) -> torch.device | None:
    """The device a `module.to(*args, **kwargs)` call moves to (None: dtype only)."""
    return torch._C._nn._parse_to(*args, **kwargs)[0]


def tree_map_only(kind: type, function: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with `function` applied to every leaf of type `kind`."""
    try:
        from torch.utils._pytree import tree_map_only as mapped
    except ImportError:
        raise missing_error("torch.utils._pytree.tree_map_only", "FSDP2 checkpoints") from None
    return mapped(kind, function, tree)


def _pytree_present() -> bool:
    import torch.utils._pytree as pytree

    return has(pytree, "tree_map_only")


APIS = [
    PrivateApi(
        "torch._C._nn._parse_to",
        "warning when a model spread over devices is moved to one",
        "required by dispatch_model's guard on .to()",
        lambda: has(torch._C._nn, "_parse_to"),
    ),
    PrivateApi(
        "torch.utils._pytree.tree_map_only",
        "FSDP2 checkpoints of optimizers that never stepped",
        "FSDP2 checkpoints say which torch they need",
        _pytree_present,
    ),
]
