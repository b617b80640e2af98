"""Loading a checkpoint into a model skeleton, tensor by tensor, where a device map says.

Safetensors files are read one tensor at a time through a memory map, so memory grows
by about one tensor on top of what stays loaded, not by a shard. A tensor mapped to
"disk" is not read at all when the checkpoint already holds it in the dtype wanted:
the offload folder's index points into the checkpoint. Everything is checked before
the first tensor moves (files, keys, shapes, devices); if loading still fails, the
tensors loaded so far go back to the meta device and files written are removed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from notebook_accel.big_modeling.device_map import (
    check_device_map,
    infer_auto_device_map,
    state_dict_names,
)
from notebook_accel.big_modeling.dispatch import check_device_value, dispatch_model, placement
from notebook_accel.big_modeling.memory import as_dtype, get_balanced_memory
from notebook_accel.big_modeling.offload import offload_weight, reference_weight, save_offload_index
from notebook_accel.big_modeling.tensors import set_module_tensor_to_device, tied_aliases

logger = logging.getLogger(__name__)

WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# a whole model's weights in one file, as save_model and transformers name it
WHOLE_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class Shard:
    """One checkpoint file and the tensor names it holds."""

    path: Path
    keys: list[str]

    @property
    def is_safetensors(self) -> bool:
        """Whether it can be read tensor by tensor."""
        return self.path.suffix == ".safetensors"


def _keys_of(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as file:
            return list(file.keys())
    return list(_torch_load(path))


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    # mmap: the pickled tensors stay in the file until touched (torch>=2.1 zip files).
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def checkpoint_shards(checkpoint: str | os.PathLike) -> list[Shard]:
    """The files of `checkpoint`: one weights file, an index json of a sharded
    checkpoint, or a folder holding either. Every shard an index names must exist.

    In a folder, a whole-model file under the name save_model and transformers give it
    comes first (the newer of the two if both are there), as in Accelerate, so the
    folder may also hold other files, an offload folder's own among them."""
    path = Path(checkpoint)
    if path.is_dir():
        whole = [path / name for name in WHOLE_MODEL_FILES if (path / name).is_file()]
        indexes = sorted(path.glob("*.index.json"))
        weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHTS_SUFFIXES)
        if whole:
            path = max(whole, key=lambda file: file.stat().st_mtime_ns)
        elif len(indexes) == 1:
            path = indexes[0]
        elif len(weights) == 1:
            path = weights[0]
        else:
            found = [p.name for p in [*indexes, *weights]] or "nothing"
            raise ValueError(
                f"{checkpoint} should hold one weights file or one '*.index.json' of a sharded "
                f"checkpoint; it holds {found}: pass the file to load"
            )
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".json":
        return _shards_of_index(path)
    if path.suffix not in WEIGHTS_SUFFIXES:
        raise ValueError(
            f"{path} is not a checkpoint: expected {WEIGHTS_SUFFIXES} or an index .json"
        )
    return [Shard(path, _keys_of(path))]


def _shards_of_index(index_path: Path) -> list[Shard]:
    """The shards an index names: `{"weight_map": {tensor: file}, ...}` as transformers
    writes it, or the `{tensor: file}` map alone."""
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{index_path} is not a checkpoint index: {error}") from error
    weight_map = index.get("weight_map", index) if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(
            f"{index_path} is not a checkpoint index: expected {{'weight_map': {{tensor: file}}}} "
            "or {tensor: file}"
        )
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    shards = []
    for file, keys in by_file.items():
        path = index_path.parent / file
        if not path.exists():
            raise FileNotFoundError(
                f"shard {file} named by {index_path.name} (for {keys[0]!r} and "
                f"{len(keys) - 1} more) is missing from {index_path.parent}: download or copy "
                "it there, then load again"
            )
        shards.append(Shard(path, keys))
    return shards


def load_state_dict(
    checkpoint_file: str | os.PathLike, device_map: Mapping[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file, by name: on the CPU, or where `device_map`
    (module or tensor name -> device) puts them ("disk", or no entry: the CPU).

    A safetensors file is read tensor by tensor, each straight to its device; a pickled
    one (`.bin`, `.pt`) is memory-mapped and loaded on the CPU.
    """
    path = Path(checkpoint_file)
    if path.suffix != ".safetensors":
        return _torch_load(path)
    with safe_open(str(path), framework="pt") as file:
        kind = (file.metadata() or {}).get("format", "pt")
        keys = list(file.keys())
    if kind != "pt":
        raise ValueError(
            f"{path} holds {kind!r} tensors (its metadata says format={kind!r}); save it from "
            "PyTorch to load it here"
        )
    by_device: dict[str, list[str]] = {}
    for key in keys:
        where = placement(key, device_map) if device_map else None
        device = "cpu" if where in (None, "disk") else where
        device = f"cuda:{device}" if isinstance(device, int) else str(device)
        by_device.setdefault(device, []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    for device, names in by_device.items():
        with safe_open(str(path), framework="pt", device=device) as file:
            for key in names:
                tensors[key] = file.get_tensor(key)
    return {key: tensors[key] for key in keys}


@dataclass
class _Target:
    """Where one checkpoint tensor goes."""

    name: str  # in the model
    device: Any  # a device map value
    dtype: torch.dtype


def _plan_targets(
    model: nn.Module,
    shards: list[Shard],
    device_map: Mapping[str, Any],
    dtype: torch.dtype | None,
    keep_in_fp32_modules: Iterable[str],
    strict: bool | None,
    offload_buffers: bool = False,
    checkpoint: str | os.PathLike = "",
) -> dict[str, _Target]:
    """checkpoint key -> target (keys of the model's state dict); skips, with a warning, the
    other keys, and with strict=True refuses them and model tensors the checkpoint lacks."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    current = {name: tensors[name] for name in state_dict_names(model)}
    fp32 = list(keep_in_fp32_modules or ())
    buffers = {name for name, _ in model.named_buffers()}
    targets: dict[str, _Target] = {}
    unknown = []
    for shard in shards:
        for key in shard.keys:
            tensor = current.get(key)
            if tensor is None:
                unknown.append((key, shard.path.name))
                continue
            wanted = tensor.dtype
            if dtype is not None and tensor.is_floating_point():
                wanted = dtype
            if tensor.is_floating_point() and any(
                key == m or key.startswith(m + ".") or f".{m}." in f".{key}" for m in fp32
            ):
                wanted = torch.float32
            where = placement(key, device_map)
            if where == "disk" and key in buffers and not offload_buffers:
                where = "cpu"  # buffers of offloaded modules live with the execution device
            targets[key] = _Target(key, where, wanted)
    if unknown and strict:
        key, file = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(
            f"checkpoint tensor {key!r} in {file}{more} matches no parameter or buffer of the "
            "model: check that the checkpoint is this model's, or pass strict=False to skip it"
        )
    if unknown:
        logger.warning(
            "checkpoint tensors %s in %s were not used when loading %s: it has no parameter or "
            "persistent buffer of those names (strict=True refuses such a checkpoint)",
            sorted(key for key, _ in unknown),
            checkpoint,
            type(model).__name__,
        )
    aliases = tied_aliases(model)
    covered = {alias for key in targets for alias in aliases.get(key, [key])}
    parameters = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in parameters if n not in covered]
    if missing and strict:
        raise ValueError(f"the checkpoint has no {missing[0]!r} ({len(missing)} missing)")
    if missing:
        logger.warning("the checkpoint lacks %d parameters, e.g. %r", len(missing), missing[0])
    return targets


def _check_shapes(model: nn.Module, shards: list[Shard], targets: Mapping[str, _Target]) -> None:
    current = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for shard in shards:
        if not shard.is_safetensors:
            continue
        with safe_open(str(shard.path), framework="pt") as file:
            for key in shard.keys:
                if key not in targets:
                    continue
                shape = tuple(file.get_slice(key).get_shape())
                if shape != tuple(current[key].shape):
                    raise ValueError(
                        f"checkpoint tensor {key!r} in {shard.path.name} has shape {shape}, "
                        f"the model's is {tuple(current[key].shape)}: the checkpoint is not "
                        "this model's (or its config differs)"
                    )


def _tensors(shard: Shard, wanted: set[str]) -> Iterator[tuple[str, Any, str | None]]:
    """(key, reader, stored dtype) for the keys in `wanted`; a reader returns the tensor
    when called (a safetensors dtype name such as "F16"; None for pickled files)."""
    if shard.is_safetensors:
        with safe_open(str(shard.path), framework="pt", device="cpu") as file:
            for key in shard.keys:
                if key in wanted:
                    stored = str(file.get_slice(key).get_dtype())
                    yield key, lambda key=key: file.get_tensor(key), stored
        return
    pickled = _torch_load(shard.path)
    for key in shard.keys:
        if key in wanted:
            yield key, (lambda k=key: pickled[k]), None


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class _Rollback:
    """What a failed load undoes: loaded tensors back to meta, written files removed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.loaded: list[str] = []
        self.files: list[Path] = []

    @contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            for name in self.loaded:
                set_module_tensor_to_device(self.model, name, "meta")
            for path in self.files:
                path.unlink(missing_ok=True)
            raise


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, Any] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Iterable[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load `checkpoint` into `model` (built with `init_empty_weights` or not), where
    `device_map` says: tensors mapped to a device are put there, those mapped to "disk"
    are offloaded to `offload_folder` (its `index.json` says where each one is).

    Args:
        model: the model to fill.
        checkpoint: a .safetensors/.bin file, a sharded checkpoint's index .json, or a
            folder with one of those.
        device_map: module or tensor name -> device (default: each tensor where it is,
            the CPU for those on the meta device).
        offload_folder: where "disk" tensors go; needed if the map has "disk".
        dtype: cast floating tensors to it (default: the model's dtype for each tensor).
        offload_state_dict: accepted for compatibility; loading is tensor by tensor anyway.
        offload_buffers: offload the buffers of "disk" modules too (default: they are
            loaded into memory, to go where the module runs).
        keep_in_fp32_modules: module names whose floating tensors stay in float32.
        strict: refuse a checkpoint with a tensor the model's state dict lacks, or that
            lacks one of the model's parameters (default: as Accelerate does, skip the
            first with a warning that names them; warn about the second).

    Raises:
        FileNotFoundError: the checkpoint, or a shard its index names, is missing.
        ValueError: a shape that differs, a device that does not exist, "disk" without
            an `offload_folder`; with `strict`, tensors that do not match.
    """
    del offload_state_dict, full_state_dict, broadcast_from_rank0
    if offload_8bit_bnb:
        raise NotImplementedError("8-bit bitsandbytes offload is not supported")
    device_map = dict(device_map) if device_map is not None else _where_tensors_are(model)
    check_device_map(model, device_map)
    for key, value in device_map.items():
        check_device_value(value, key)
    if "disk" in device_map.values() and offload_folder is None:
        raise ValueError(
            "the device map offloads some modules to 'disk': pass offload_folder= (a folder "
            "with room for them)"
        )
    shards = checkpoint_shards(checkpoint)
    targets = _plan_targets(
        model,
        shards,
        device_map,
        as_dtype(dtype),
        keep_in_fp32_modules or (),
        strict,
        offload_buffers,
        checkpoint,
    )
    _check_shapes(model, shards, targets)
    _load(model, shards, targets, offload_folder)


def _where_tensors_are(model: nn.Module) -> dict[str, Any]:
    """A device map that leaves each tensor where it is (those on meta go to the CPU)."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    devices = {t.device for t in tensors.values() if t.device.type != "meta"}
    if len(devices) <= 1:
        return {"": devices.pop() if devices else torch.device("cpu")}
    return {name: "cpu" if t.device.type == "meta" else t.device for name, t in tensors.items()}


def _load(
    model: nn.Module,
    shards: list[Shard],
    targets: Mapping[str, _Target],
    offload_folder: str | os.PathLike | None,
) -> None:
    aliases = tied_aliases(model)
    index: dict[str, dict] = {}
    rollback = _Rollback(model)
    with rollback.guard():
        for shard in shards:
            for key, read, stored in _tensors(shard, set(targets)):
                target = targets[key]
                if target.device == "disk":
                    _to_disk(
                        model, shard, key, read, stored, target, offload_folder, index, rollback
                    )
                    continue
                device = (
                    f"cuda:{target.device}" if isinstance(target.device, int) else target.device
                )
                set_module_tensor_to_device(model, key, device, value=read(), dtype=target.dtype)
                rollback.loaded.extend(aliases.get(key, [key]))
                _retie(model, key, aliases)
        if index:
            save_offload_index(index, offload_folder)


def _to_disk(model, shard, key, read, stored, target, folder, index, rollback) -> None:
    # The model keeps a meta placeholder in the dtype the weight will run in.
    placeholder = torch.empty(_shape(model, key), device="meta")
    set_module_tensor_to_device(model, key, "meta", value=placeholder, dtype=target.dtype)
    if stored is not None and stored == _SAFETENSORS_DTYPES.get(target.dtype):
        reference_weight(key, shard.path, key, index)  # already on disk as wanted
        return
    offload_weight(read().to(target.dtype), key, folder, index)
    rollback.files.append(Path(folder) / index[key]["file"])


def _shape(model: nn.Module, key: str) -> torch.Size:
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner)
    return (
        module._parameters.get(leaf) if leaf in module._parameters else module._buffers[leaf]
    ).shape


def _retie(model: nn.Module, key: str, aliases: Mapping[str, list[str]]) -> None:
    """Give every name tied to `key` the tensor just loaded for it."""
    names = aliases.get(key)
    if not names:
        return
    owner_name, _, leaf = key.rpartition(".")
    loaded = model.get_submodule(owner_name)._parameters[leaf]
    for name in names:
        if name != key:
            other, _, other_leaf = name.rpartition(".")
            model.get_submodule(other)._parameters[other_leaf] = loaded


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | Mapping[str, Any] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: Iterable[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load `checkpoint` into `model` and spread it over the devices: the one call for a
    model bigger than a GPU, or than the RAM.

        with init_empty_weights():
            model = MyModel(config)
        model = load_checkpoint_and_dispatch(
            model, "checkpoint/", device_map="auto", max_memory={"cpu": "2GB"},
            no_split_module_classes=["Block"], offload_folder="offload",
        )

    `device_map`: a map, or "auto"/"balanced" (spread evenly over the GPUs, then CPU,
    then disk), "balanced_low_0" (GPU 0 kept light), "sequential" (fill GPU 0 first).
    The rest as in `infer_auto_device_map`, `load_checkpoint_in_model` and `dispatch_model`.
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r}: use a dict or one of {DEVICE_MAP_STRATEGIES}"
            )
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split_module_classes,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
        )
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map=device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )
