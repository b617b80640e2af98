"""Sharded training with PyTorch's FSDP2 (`fully_shard`), and sharded checkpoints.

`shard_model` applies `fully_shard` to the submodules the plugin's wrap policy
picks, then to the model itself. The model stays the same Python object:
`fully_shard` swaps its class for a subclass (`FSDPMyModel`) and replaces each
parameter with a DTensor holding this process's shard. An optimizer created
before sharding still points at the old parameters, so
`switch_optimizer_parameters` swaps them for the shards.

Checkpoints go through `torch.distributed.checkpoint` (DCP): every process
writes its own shards (`sharded_save`) and reads back whatever part of them its
own shards need (`sharded_load`), so a checkpoint saved by two processes loads
on one or on four. `full_state_dict` gathers the whole weights on the main
process.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from notebook_accel.config import LaunchSettings
from notebook_accel.kwargs import FullyShardedDataParallelPlugin

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# The compute dtype FSDP gathers parameters in, for each Accelerator precision.
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}


def plugin_for(
    plugin: FullyShardedDataParallelPlugin | None, launch: LaunchSettings | None
) -> FullyShardedDataParallelPlugin | None:
    """The plugin given to the Accelerator, else the launch's `fsdp` settings, else None."""
    if plugin is not None:
        if not isinstance(plugin, FullyShardedDataParallelPlugin):
            raise TypeError(
                "fsdp_plugin must be a FullyShardedDataParallelPlugin, "
                f"not {type(plugin).__name__}."
            )
        return plugin
    if launch is not None and launch.fsdp is not None:
        return FullyShardedDataParallelPlugin.from_dict(dict(launch.fsdp))
    return None


# -- sharding ----------------------------------------------------------------------


def shard_model(
    model: torch.nn.Module,
    plugin: FullyShardedDataParallelPlugin,
    precision: str,
    device: torch.device,
    pin_memory: bool = False,
) -> ShardMap:
    """Shard `model` in place over all processes; return which shard replaced which parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if is_sharded(model):  # prepared before: fully_shard twice would fail
        return ShardMap()
    before = dict(model.named_parameters())
    options: dict[str, Any] = {
        # An explicit mesh: torch's default follows the machine's accelerator, not `cpu=True`.
        "mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
        "mp_policy": mixed_precision_policy(plugin, precision),
        # Pinned memory needs a GPU (the platform says); on CPU-only torch it fails
        # with "Cannot access accelerator device when none is available".
        "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)
        if plugin.cpu_offload
        else OffloadPolicy(),
    }
    for module in wrap_targets(model, plugin):
        fully_shard(module, reshard_after_forward=plugin.reshard_after_forward, **options)
    # The root keeps torch's default: its parameters stay gathered after forward,
    # because backward needs them first.
    fully_shard(model, **options)
    after = dict(model.named_parameters())
    shards = ShardMap()
    for name, old in before.items():
        shards.add(old, after[name])
    return shards


class ShardMap:
    """Which shard replaced which parameter, without keeping the old parameters alive.

    (A `WeakKeyDictionary` cannot hold tensors: its lookups compare them with `==`.)
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}

    def add(self, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
        self._entries[id(old)] = (weakref.ref(old), new)

    def update(self, other: ShardMap) -> None:
        self._entries.update(other._entries)

    def get(self, old: torch.Tensor) -> torch.nn.Parameter | None:
        """The shard that replaced `old`, or None."""
        entry = self._entries.get(id(old))
        return entry[1] if entry is not None and entry[0]() is old else None


def mixed_precision_policy(plugin: FullyShardedDataParallelPlugin, precision: str) -> Any:
    """The plugin's MixedPrecisionPolicy, or one built from the Accelerator's precision.

    Parameters are gathered in the compute dtype (bf16 or fp16); gradients are
    reduced in float32, so the sum over processes loses nothing.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = plugin.mixed_precision_policy
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, dict):
        return MixedPrecisionPolicy(**{key: _dtype(value) for key, value in policy.items()})
    dtype = _PRECISION_DTYPES.get(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES[str(value).lower()]


def wrap_targets(
    model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin
) -> list[torch.nn.Module]:
    """The submodules that get their own shard group, innermost first (never the root).

    A module that shares a parameter with code outside it (tied embeddings) is
    left to its parent: FSDP2 refuses a parameter owned by two groups.
    """
    policy = plugin.auto_wrap_policy
    if policy == "no_wrap":
        return []
    if policy == "transformer_based_wrap":
        names = set(
            plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or []
        )
        present = {type(module).__name__ for module in model.modules()}
        if not names & present:
            raise ValueError(
                "transformer_based_wrap found no module of class "
                f"{', '.join(sorted(names)) or '(none given)'} in the model; its module classes "
                f"are {', '.join(sorted(present))}. Set transformer_cls_names_to_wrap."
            )
    uses = _parameter_uses(model)
    targets: list[torch.nn.Module] = []
    covered: set[int] = set()
    # Reversed pre-order puts every module after all of its descendants.
    for module in reversed(list(model.modules())[1:]):
        if _parameter_uses(module).items() - uses.items():
            continue
        if policy == "transformer_based_wrap":
            chosen = type(module).__name__ in names
        elif policy == "size_based_wrap":
            chosen = (
                sum(p.numel() for p in module.parameters() if id(p) not in covered)
                >= plugin.min_num_params
            )
        else:
            chosen = bool(policy(module))
        if chosen and any(True for _ in module.parameters()):
            targets.append(module)
            covered.update(id(p) for p in module.parameters())
    return targets


def _parameter_uses(module: torch.nn.Module) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    return counts


def switch_optimizer_parameters(optimizer: torch.optim.Optimizer, shards: ShardMap) -> None:
    """Point `optimizer` at the shards of the parameters it was created with."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        params = group["params"]
        if all(shards.get(p) is None for p in params):
            continue
        if any(p in inner.state for p in params):
            raise ValueError(
                "the optimizer has already stepped on the unsharded parameters; pass it to "
                "prepare() together with the model, before training."
            )
        group["params"] = [p if shards.get(p) is None else shards.get(p) for p in params]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (unsharded) without the reduce-scatter inside the block."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this process holds (its shards, for a sharded model)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        total += local.numel() * local.element_size()
    return total


# -- checkpoints -------------------------------------------------------------------

METADATA_FILE = ".metadata"


def is_sharded_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a checkpoint written by `sharded_save`."""
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def sharded_save(
    directory: str | os.PathLike,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Write the models' and optimizers' state as a DCP checkpoint; every process calls it.

    Each process writes its own shards (`__<rank>_0.distcp`), the main process
    the `.metadata` index. Keys are `model_<i>` and `optimizer_<i>`. All
    processes must see `directory` (one machine, or a shared file system).
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(models, optimizers), checkpoint_id=directory, no_dist=not _distributed())


def sharded_load(
    directory: str | os.PathLike,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Load a `sharded_save` checkpoint into the models and optimizers, in place.

    Works with any number of processes and with sharded or plain models: each
    process reads the parts its own parameters need.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"no sharded checkpoint (no {METADATA_FILE}) in {directory!r}.")
    state = _state(models, optimizers)
    dcp.load(state, checkpoint_id=directory, no_dist=not _distributed())
    for index, model in enumerate(models):
        set_model_state_dict(model, state[f"model_{index}"])
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(
            _owner(models, optimizer), _inner(optimizer), state[f"optimizer_{index}"]
        )


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on the CPU of the main process ({} elsewhere); every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _state(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {}
    for index, model in enumerate(models):
        state[f"model_{index}"] = get_model_state_dict(model)
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(
            _owner(models, optimizer), _inner(optimizer)
        )
    return state


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _owner(models: Sequence[torch.nn.Module], optimizer: Any) -> torch.nn.Module:
    """The model whose parameters `optimizer` updates."""
    mine = {id(p) for group in _inner(optimizer).param_groups for p in group["params"]}
    for model in models:
        if mine & {id(p) for p in model.parameters()}:
            return model
    raise ValueError("an optimizer updates none of the models being saved; prepare them together.")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
