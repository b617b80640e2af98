"""The few `notebook_accel.utils` functions that are not collectives of `ops` already."""

from __future__ import annotations

from typing import Any

import torch

from notebook_accel.training import ops
from notebook_accel.training.nested import apply_to_tensors


def send_to_device(
    tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys: Any = None
) -> Any:
    """Move every tensor in nested lists, tuples and dicts (or anything with `.to`) to `device`.

    Keys named in `skip_keys` (a string or a list) of dicts are left where they are.
    """
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if isinstance(tensor, dict) and skip:
        return type(tensor)(
            {
                key: value if key in skip else send_to_device(value, device, non_blocking)
                for key, value in tensor.items()
            }
        )
    if not isinstance(tensor, (torch.Tensor, list, tuple, dict)) and callable(
        getattr(tensor, "to", None)
    ):
        return tensor.to(device)  # a BatchEncoding or similar
    return apply_to_tensors(lambda t: t.to(device, non_blocking=non_blocking), tensor)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's `tensor` on every process (the others pass None), on their device."""
    from notebook_accel.training.state import PartialState

    state = PartialState()
    meta = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
    ops.broadcast_object_list(meta, from_process=0)
    shape, dtype = meta[0]
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype)
    return ops.broadcast(tensor.to(state.device), from_process=0)


def synchronize_rng_state(
    rng_type: str | None = None, generator: torch.Generator | None = None
) -> None:
    """Give this process's generator of `rng_type` the main process's state.

    `rng_type`: "torch" (the CPU generator), "cuda", "xla" (the platform's device
    generator) or "generator" (the `generator` given).
    """
    if ops.world_size() == 1:
        return
    if rng_type == "generator":
        if generator is None:
            raise ValueError('synchronize_rng_state("generator") needs generator=...')
        ops.sync_generator(generator)
        return
    if rng_type == "torch":
        state = torch.get_rng_state()
        ops.broadcast(state, 0)
        torch.set_rng_state(state)
        return
    from notebook_accel.training.state import PartialState

    # The platform's device generators ("cuda", "xla"), as its checkpoints save them.
    platform = PartialState().platform
    states = [platform.rng_states()]
    ops.broadcast_object_list(states, from_process=0)
    platform.set_rng_states(states[0])


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """`synchronize_rng_state` for each of `rng_types`."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator)


def wait_for_everyone() -> None:
    """Block until every process reaches this line."""
    from notebook_accel.training.state import PartialState

    PartialState().wait_for_everyone()
