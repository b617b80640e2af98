"""Sharded training with PyTorch's FSDP2 (`fully_shard`), and sharded checkpoints.

`shard_model` applies `fully_shard` to the submodules the plugin's wrap policy
picks, then to the model itself. The model stays the same Python object:
`fully_shard` swaps its class for a subclass (`FSDPMyModel`) and replaces each
parameter with a DTensor holding this process's shard. An optimizer created
before sharding still points at the old parameters, so
`switch_optimizer_parameters` swaps them for the shards.

Checkpoints go through `torch.distributed.checkpoint` (DCP), in one of two
layouts. Into one directory that every process sees, every process writes its
own shards and the main process one index of them all (`sharded_save`); each
process reads back whatever part of them its own shards need (`sharded_load`),
so a checkpoint saved by two processes loads on one or on four. Where the
processes save into directories of their own, each writes a DCP checkpoint of
its own shards alone, index and replicated values included
(`save_own_shards`), which it reads back by itself (`read_own_shards`, then
`set_state`): the same number of processes with the same sharding only.
`full_state_dict` gathers the whole weights on the main process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin
from notebook_accel.config.settings import LaunchSettings

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
    mesh: Any = None,
) -> ShardMap:
    """Shard `model` in place over all processes (or over `mesh`: 2-D replicate x shard
    for HSDP); return which shard replaced which parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if is_sharded(model):  # prepared before: fully_shard twice would fail
        return ShardMap()
    before = dict(model.named_parameters())
    if mesh is None:
        # An explicit mesh: torch's default follows the machine's accelerator, not `cpu=True`.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {
        "mesh": mesh,
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
        self._replaced_by: dict[int, list[int]] = {}  # id(new) -> the ids it replaced

    def add(self, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
        # A parameter replaced twice (split over tp, then sharded by FSDP): what was
        # replaced by the middle one is now replaced by the last.
        replaced = self._replaced_by.pop(id(old), []) + [id(old)]
        self._entries[id(old)] = (weakref.ref(old), new)
        for key in replaced:
            self._entries[key] = (self._entries[key][0], new)
        self._replaced_by.setdefault(id(new), []).extend(replaced)

    def update(self, other: ShardMap) -> None:
        for ref, new in other._entries.values():
            old = ref()
            if old is not None:
                self.add(old, new)

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

    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"no sharded checkpoint (no {METADATA_FILE}) in {directory!r}.")
    state = _state(models, optimizers)
    dcp.load(state, checkpoint_id=directory, no_dist=not _distributed())
    set_state(models, optimizers, state)


def save_own_shards(
    directory: str | os.PathLike,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Write this process's part of the models' and optimizers' state as a DCP checkpoint
    of its own, which loads without any other process's files.

    DCP saves without coordinating (`no_dist`): no other process's plan is
    asked for, so `directory` gets this process's shards, an index of them
    alone (`.metadata`) and its own copy of every value the processes hold
    alike (an optimizer's `step`, which a coordinated save writes into one
    process's file only). Each process needs a directory of its own.
    """
    import torch.distributed.checkpoint as dcp

    with _without_single_process_warning():
        dcp.save(_state(models, optimizers), checkpoint_id=directory, no_dist=True)


def read_own_shards(
    directory: str | os.PathLike,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, Any]:
    """Read what `save_own_shards` wrote into new tensors, changing no model or optimizer;
    apply the result with `set_state`.

    Raises ValueError, naming the first differences, when the saved shards are
    not the ones this process holds (another number of processes, other FSDP
    settings, a model that is not sharded now), or the directory cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from notebook_accel.internals.tensors import tree_map_only

    empty = [optimizer for optimizer in optimizers if not _inner(optimizer).state]
    state = _state(models, optimizers)
    # get_optimizer_state_dict makes the state of an optimizer that never stepped by
    # stepping it once with lr=0; set_state does that again, so undo it until then.
    for optimizer in empty:
        _inner(optimizer).state.clear()
    try:
        saved = dcp.FileSystemReader(directory).read_metadata()
    except Exception as error:  # missing, or a damaged pickle (which raises many kinds)
        raise ValueError(f"its index cannot be read: {error}") from None
    problems = _shard_problems(saved, state)
    if problems:
        raise ValueError("; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""))
    loaded = tree_map_only(torch.Tensor, torch.empty_like, state)  # DTensors stay DTensors
    try:
        with _without_single_process_warning():
            dcp.load(loaded, checkpoint_id=directory, no_dist=True)
    except CheckpointException as error:  # a BaseException: DCP's wrapper of any failure
        # Its text is the whole traceback; `failures` holds (exception, stack) per rank.
        causes = [failure[0] for failure in error.failures.values()]
        raise ValueError("; ".join(map(str, causes)) or str(error)) from None
    return loaded


def set_state(
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    state: dict[str, Any],
) -> None:
    """Load a state read by DCP (keys `model_<i>`, `optimizer_<i>`) into the models and
    optimizers."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for index, model in enumerate(models):
        set_model_state_dict(model, state[f"model_{index}"])
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(
            _owner(models, optimizer), _inner(optimizer), state[f"optimizer_{index}"]
        )


def _shard_problems(saved: Any, state: dict[str, Any]) -> list[str]:
    """How the tensors of the DCP index `saved` differ from the parts of `state` this
    process holds; empty when each is the same part of the same whole.

    DCP itself reads only where the saved and the held parts overlap, and leaves
    the rest of a tensor as it was, so a checkpoint of other shards would load
    half.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = saved.planner_data or {}  # each flattened key's place in the nested state
    problems = []
    for key, stored in saved.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        held = _element(state, paths.get(key, (key,)))
        if not isinstance(held, torch.Tensor):
            problems.append(f"{key} is saved but is not in this run's models and optimizers")
            continue
        kept = [(tuple(c.offsets), tuple(c.sizes)) for c in stored.chunks]
        if tuple(stored.size) != tuple(held.size()) or kept != _chunks(held):
            problems.append(
                f"{key} was saved as {_described(kept, stored.size)}, this process holds "
                f"{_described(_chunks(held), held.size())}"
            )
    return problems


def _element(state: Any, path: Sequence[Any]) -> Any:
    """The value at `path` (keys and indices) in the nested `state`, or None."""
    for part in path:
        try:
            state = state[part]
        except (KeyError, IndexError, TypeError):
            return None
    return state


def _chunks(tensor: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) of the parts of `tensor` this process holds, as DCP indexes them."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):  # DTensor's own answer to DCP
        return [(tuple(c.offsets), tuple(c.sizes)) for c in tensor.__create_chunk_list__()]
    return [((0,) * tensor.dim(), tuple(tensor.size()))]


def _described(chunks: list[tuple[tuple[int, ...], ...]], size: Sequence[int]) -> str:
    whole = [((0,) * len(size), tuple(size))]
    if chunks == whole:
        return f"the whole {list(size)}"
    parts = ", ".join(f"{list(sizes)} at {list(offsets)}" for offsets, sizes in chunks)
    return f"the part {parts} of {list(size)}"


@contextlib.contextmanager
def _without_single_process_warning() -> Iterator[None]:
    """DCP warns that distributed is off whenever `no_dist` is asked for on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def has_distributed_tensors(model: torch.nn.Module) -> bool:
    """Whether some parameter of `model` is a DTensor (sharded or split over processes)."""
    if not _distributed():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


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
