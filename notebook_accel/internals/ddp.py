"""DistributedDataParallel's reducer and process group.

- Moving a live worker's DDP model to a process group formed again: DDP has no public
  way; its `_update_process_group` (made for elastic training) does it without a
  collective. Where it is missing or fails, notebook_accel/live/regroup.py builds the
  wrapper again around the same module, which needs the hooks DDP registered
  (`_accum_grad_hooks`, `reducer._remove_autograd_hooks`) and its settings
  (`_comm_hooks`, `_bucket_config`, `_delay_all_reduce_params`).
- The gradient-bucket layout kept across a resume (notebook_accel/training/
  ddp_buckets.py): `reducer._rebuild_buckets` and `reducer._get_zeros_like_grad_buckets`.

tests/live/test_ddp_private_api.py and tests/checkpoint fail on a torch release where
these no longer do what is relied on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from notebook_accel.internals.api import PrivateApi, has

_BUCKETS = ("_rebuild_buckets", "_get_zeros_like_grad_buckets")


def update_process_group(model: DistributedDataParallel, group: dist.ProcessGroup) -> bool:
    """Move `model` to `group` with DDP's `_update_process_group`; False where that is
    gone, raises (its signature or checks changed), or leaves the model on its old group."""
    update = getattr(model, "_update_process_group", None)
    if not callable(update):
        return False
    try:
        update(group)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False
    return model.process_group is group


def bucket_parameters(model: DistributedDataParallel) -> list[list[torch.nn.Parameter]] | None:
    """The parameters of each gradient bucket `model` uses from its next step on (the
    rebuild DDP would make at its next forward made now); None where the reducer cannot
    tell (a resume then sums as DDP alone does)."""
    reducer = getattr(model, "reducer", None)
    if reducer is None or not has(reducer, *_BUCKETS):
        return None
    reducer._rebuild_buckets()  # what DDP's next forward would do first
    return [list(bucket.parameters()) for bucket in reducer._get_zeros_like_grad_buckets()]


def comm_hooks(model: DistributedDataParallel) -> list[tuple[Callable, Any]]:
    """The (hook, state) pairs registered with register_comm_hook (DDP does not list its
    built-in hooks here: `builtin_comm_hook` names those)."""
    return list(getattr(model, "_comm_hooks", []))


def builtin_comm_hook(model: DistributedDataParallel) -> str:
    """The name of the C++ communication hook DDP reports, "" when none."""
    with contextlib.suppress(Exception):
        return str(model._get_ddp_logging_data().get("comm_hook", ""))
    return ""


def per_bucket_caps(model: DistributedDataParallel) -> tuple[int, ...]:
    """The bucket sizes the user gave one by one (bucket_cap_mb_list), in bytes."""
    return tuple(getattr(getattr(model, "_bucket_config", None), "per_bucket_bytes_caps", ()))


def delays_all_reduce(model: DistributedDataParallel) -> bool:
    """Whether `model` all-reduces some parameters after the backward (a DDP option)."""
    return bool(getattr(model, "_delay_all_reduce_params", None))


def remove_gradient_hooks(model: DistributedDataParallel) -> None:
    """Take DDP's gradient hooks off the parameters (before building it again). The
    Python reducer's call the same object: they would all-reduce each gradient a second
    time. The C++ reducer's go when it is freed; taken off here too, in case something
    else still holds it."""
    for handle in getattr(model, "_accum_grad_hooks", []):
        handle.remove()
    with contextlib.suppress(Exception):  # freeing the reducer is enough
        model.reducer._remove_autograd_hooks()


APIS = [
    PrivateApi(
        "DistributedDataParallel._update_process_group",
        "moving a live worker's DDP model to its group formed again",
        "the DDP wrapper is built again around the same module (a warning says so)",
        lambda: has(DistributedDataParallel, "_update_process_group"),
    ),
    PrivateApi(
        "Reducer._rebuild_buckets, Reducer._get_zeros_like_grad_buckets",
        "a resume at 3 or more processes that sums gradients bit for bit as before",
        "a resume sums as DDP alone does (equal to about 1e-8)",
        lambda: has(dist.Reducer, *_BUCKETS),
    ),
    PrivateApi(
        "Reducer._remove_autograd_hooks",
        "building a live worker's DDP wrapper again",
        "the old reducer's hooks go when it is freed",
        lambda: has(dist.Reducer, "_remove_autograd_hooks"),
    ),
    PrivateApi(
        "DistributedDataParallel._get_ddp_logging_data",
        "naming a built-in communication hook lost when a DDP wrapper is built again",
        "the warning does not name the hook",
        lambda: has(DistributedDataParallel, "_get_ddp_logging_data"),
    ),
]
