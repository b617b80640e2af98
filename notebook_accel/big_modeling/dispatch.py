"""dispatch_model, cpu_offload, disk_offload, attach_align_device_hook: a model spread
over devices, run as one.

A plan says, before anything moves, where each tensor goes: resident on a device, or
offloaded (kept in CPU memory or in the offload folder, on the meta device in the
model) and loaded by the forward of one module. Then tensors move and `DeviceHook`s
(hooks.py) are attached; removing them puts the model back as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from notebook_accel.big_modeling import devices
from notebook_accel.big_modeling.device_map import check_device_map
from notebook_accel.big_modeling.hooks import (
    DeviceHook,
    ModuleHook,
    Original,
    TiedGroups,
    add_hook_to_module,
    guard_moves,
    has_hooks,
    remove_hook_from_module,
    remove_hook_from_submodules,
    send,
)
from notebook_accel.big_modeling.memory import NAMED_DEVICES
from notebook_accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    load_offload_index,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from notebook_accel.big_modeling.tensors import _parameter_like, owner_of, tied_aliases


def check_device_value(device: Any, key: str) -> None:
    """Refuse what a device map cannot hold, naming the entry."""
    if isinstance(device, torch.device):
        device = str(device)
    ok = isinstance(device, int) and not isinstance(device, bool) and device >= 0
    indexed = devices.index_device_type()
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        ok = device in NAMED_DEVICES or (
            kind in ("cuda", "cpu", "mps", indexed) and (not index or index.isdigit())
        )
    if not ok:
        named = f"'{indexed}:N', " if indexed else "'cuda:N', "
        raise ValueError(
            f"device_map[{key!r}] = {device!r} is not a device: use an accelerator index "
            f"(0, 1, ...), {named}'mps', 'cpu' or 'disk'"
        )
    index = device if isinstance(device, int) else None
    if isinstance(device, str) and device.partition(":")[0] in (indexed, "cuda"):
        index = int(device.partition(":")[2] or 0)
    count = devices.index_device_count()
    if index is not None and index >= count:
        raise ValueError(
            f"device_map[{key!r}] = {device!r} names device {index}, but this machine has "
            f"{count} visible {indexed or 'accelerator'} device(s): map it to an existing "
            "one, 'cpu' or 'disk'"
        )


def _device(value: int | str | torch.device) -> torch.device:
    if isinstance(value, int):
        return devices.indexed_device(value)
    return torch.device(value)


def placement(name: str, device_map: Mapping[str, Any]) -> Any:
    """The entry of the longest key that is `name` or a module holding it (None if none)."""
    parts = name.split(".")
    for depth in range(len(parts), 0, -1):
        key = ".".join(parts[:depth])
        if key in device_map:
            return device_map[key]
    return device_map.get("")


@dataclass
class _Plan:
    """Where each tensor goes and which modules are hooked, checked before anything moves."""

    resident: dict[str, torch.device] = field(default_factory=dict)
    offloaded: set[str] = field(default_factory=set)
    execution: dict[str, torch.device] = field(default_factory=dict)  # module -> device
    loaders: dict[str, str] = field(default_factory=dict)  # offloaded tensor -> loading module
    aliases: dict[str, list[str]] = field(default_factory=dict)  # tied names, as tied_aliases


def _loading_module(model: nn.Module, tensor: str, preload: set[str]) -> str:
    """The module whose forward loads `tensor`: its owner, or the outermost preloaded class."""
    owner = tensor.rpartition(".")[0]
    parts = owner.split(".") if owner else []
    for depth in range(len(parts) + 1):
        candidate = ".".join(parts[:depth])
        if type(model.get_submodule(candidate)).__name__ in preload:
            return candidate
    return owner


def _plan(
    model: nn.Module,
    device_map: Mapping[str, Any],
    main_device: torch.device,
    offload_buffers: bool,
    preload: set[str],
    offload_cpu: bool,
) -> _Plan:
    plan = _Plan(aliases=tied_aliases(model))
    buffers = {name for name, _ in model.named_buffers()}
    tensors = [name for name, _ in model.named_parameters(remove_duplicate=False)] + list(buffers)
    for name in tensors:
        # A tensor the map leaves out (a non-persistent buffer) runs where the model does.
        where = placement(name, device_map)
        away = where == "disk" or (where == "cpu" and offload_cpu)
        if away and (offload_buffers or name not in buffers):
            plan.offloaded.add(name)
            plan.loaders[name] = _loading_module(model, name, preload)
        else:
            stays = away or where in ("disk", None)
            plan.resident[name] = main_device if stays else _device(where)
    # A tensor tied to a resident one stays with it (one tensor, one place).
    for name, names in plan.aliases.items():
        resident = [n for n in names if n in plan.resident]
        if name in plan.offloaded and resident:
            plan.offloaded.discard(name)
            plan.loaders.pop(name, None)
            plan.resident[name] = plan.resident[resident[0]]
    for key, value in device_map.items():
        if not _is_module(model, key) and not _is_tensor(model, key):
            continue  # a key that names nothing (check_device_map warned)
        module = key if _is_module(model, key) else key.rpartition(".")[0]
        away = value == "disk" or (value == "cpu" and offload_cpu)
        plan.execution.setdefault(module, main_device if away else _device(value))
    for module in plan.loaders.values():
        plan.execution.setdefault(module, main_device)
    return plan


def _is_module(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), nn.Module)
    except AttributeError:
        return False


def _is_tensor(model: nn.Module, name: str) -> bool:
    try:
        owner_of(model, name)
    except ValueError:
        return False
    return True


def _weights_for(
    model: nn.Module,
    plan: _Plan,
    state_dict: Mapping[str, torch.Tensor] | None,
    offload_dir: str | os.PathLike | None,
    offload_index: Mapping[str, dict] | None,
    disk: set[str] = frozenset(),
) -> OffloadedWeightsLoader:
    """Where each offloaded tensor is read from; refuses, before anything moved, a tensor
    that is nowhere (on the meta device and in no state dict or offload folder)."""
    index = dict(offload_index or (load_offload_index(offload_dir) if offload_dir else {}))
    given = dict(state_dict or {})
    cpu: dict[str, torch.Tensor] = {}
    to_disk: dict[str, torch.Tensor] = {}
    current = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name in sorted(plan.offloaded):
        source = next((n for n in plan.aliases.get(name, [name]) if n in given or n in index), None)
        if source is not None:
            if source in given:
                cpu[name] = given[source]
            elif source != name:
                index[name] = index[source]
            continue
        tensor = current[name]
        if tensor.device.type == "meta":
            raise ValueError(
                f"{name!r} is on the meta device and in no state_dict or offload folder: "
                "load its weights (load_checkpoint_and_dispatch) or pass state_dict/offload_dir"
            )
        if name in disk and offload_dir is not None:
            to_disk[name] = tensor
        else:
            cpu[name] = tensor.detach().to("cpu")
    if to_disk:
        written: dict[str, dict] = {}
        for name, tensor in to_disk.items():
            offload_weight(tensor, name, offload_dir, written)
        save_offload_index(written, offload_dir)
        index.update(written)
    return OffloadedWeightsLoader(state_dict=cpu, save_folder=offload_dir, index=index)


def _install(
    model: nn.Module,
    plan: _Plan,
    weights: OffloadedWeightsLoader,
    skip_keys: Iterable[str] | str | None,
) -> None:
    """Move the resident tensors, empty the offloaded ones, attach the hooks."""
    skip = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or []) or None
    groups = {tuple(names) for names in plan.aliases.values()}
    ties = TiedGroups.of(g for g in groups if any(name in plan.offloaded for name in g))
    originals: dict[str, Original] = {}
    placeholders: dict[str, torch.Tensor] = {}
    by_tensor: dict[int, torch.Tensor] = {}  # tied names share one placeholder: still tied
    for name in sorted(plan.offloaded):
        owner, leaf = owner_of(model, name)
        tensor = owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]
        if tensor.device.type != "meta":
            originals[name] = Original(tensor.device, tensor.dtype)
        if id(tensor) not in by_tensor:
            by_tensor[id(tensor)] = _placeholder(tensor, leaf in owner._parameters)
        placeholders[name] = by_tensor[id(tensor)]
    shared: dict[int, Any] = {}
    for name, device in plan.resident.items():
        _move(model, name, device, shared)
    for name, placeholder in placeholders.items():
        owner, leaf = owner_of(model, name)
        slots = owner._parameters if leaf in owner._parameters else owner._buffers
        slots[leaf] = placeholder
    hooks: dict[str, DeviceHook] = {
        module: DeviceHook(execution_device=device, weights=weights, skip_keys=skip, ties=ties)
        for module, device in plan.execution.items()
    }
    for name, module in plan.loaders.items():
        local = name[len(module) + 1 :] if module else name
        hooks[module].offloaded[local] = name
        hooks[module].placeholders[local] = placeholders[name]
        if name in originals:
            hooks[module].originals[local] = originals[name]
    if "" in hooks:
        hooks[""].io_same_device = True
    else:
        first = next(iter(plan.execution.values()), torch.device("cpu"))
        hooks[""] = DeviceHook(
            execution_device=first, io_same_device=True, skip_keys=skip, ties=ties
        )
    for module, hook in hooks.items():
        add_hook_to_module(model.get_submodule(module), hook)


def _placeholder(tensor: torch.Tensor, is_parameter: bool) -> torch.Tensor:
    """A meta tensor of `tensor`'s shape and dtype; a parameter of its class, with its
    requires_grad, for a parameter."""
    meta = tensor.detach().to("meta")
    return _parameter_like(tensor, meta) if is_parameter else meta


def _move(model: nn.Module, name: str, device: torch.device, shared: dict[int, Any]) -> None:
    owner, leaf = owner_of(model, name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        if id(old) not in shared:  # tied names get the very same new parameter
            shared[id(old)] = (
                old if old.device == device else _parameter_like(old, old.detach().to(device))
            )
        owner._parameters[leaf] = shared[id(old)]
    else:
        owner._buffers[leaf] = owner._buffers[leaf].to(device)


def _main_device(device_map: Mapping[str, Any]) -> torch.device:
    values = list(device_map.values())
    if set(values) <= {"cpu", "disk"}:
        return torch.device("cpu")
    return _device(next(v for v in values if v not in ("cpu", "disk")))


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, Any],
    main_device: int | str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: Mapping[str, dict] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: Iterable[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Spread `model` over the devices of `device_map` and hook it to run as one model.

    Modules mapped to a GPU index (or "cpu" on a machine that runs on the CPU) are moved
    there; those mapped to "cpu" when a GPU runs the model, and those mapped to "disk",
    are offloaded: their weights are kept in CPU memory or in `offload_dir` and brought
    to `main_device` for each forward. Inputs follow each module; outputs come back
    where the inputs were. `remove_hook_from_submodules(model)` undoes the offloading.

    Args:
        model: the model (tensors on the meta device must be found in `state_dict`
            or the offload folder). Hooks attached before are removed first.
        device_map: module or tensor name -> device, as `infer_auto_device_map` returns.
        main_device: where offloaded modules run (default: the first GPU in the map, or
            the CPU).
        state_dict: CPU tensors for the offloaded modules, by name in the model.
        offload_dir: the offload folder for "disk" modules (written if their weights are
            in the model).
        offload_index: the folder's index, if not read from `offload_dir/index.json`.
        offload_buffers: offload buffers with the parameters (default: buffers go to
            `main_device` for good).
        skip_keys: keyword arguments never moved between devices (a cache object, say).
        preload_module_classes: class names whose whole subtree of weights is loaded
            in their own pre-hook (blocks that use a child's weight directly).
        force_hooks: hook the model even if it all lives on one device.

    Raises:
        ValueError: an unknown device, a tensor the map leaves out, "disk" without an
            offload folder, or an offloaded tensor with no weights anywhere. Nothing is
            moved then.
    """
    check_device_map(model, device_map)
    for key, value in device_map.items():
        check_device_value(value, key)
    if has_hooks(model):
        remove_hook_from_submodules(model)
    devices = {str(v) for v in device_map.values()}
    if len(devices) == 1 and "disk" not in devices and not force_hooks:
        model.to(_device(next(iter(device_map.values()))))
        model.hf_device_map = dict(device_map)
        return model
    main = _device(main_device) if main_device is not None else _main_device(device_map)
    plan = _plan(
        model,
        device_map,
        main,
        offload_buffers,
        set(preload_module_classes or ()),
        offload_cpu=main.type != "cpu",
    )
    disk = {n for n in plan.offloaded if placement(n, device_map) == "disk"}
    if disk and offload_dir is None and offload_index is None:
        missing = [n for n in sorted(disk) if n not in (state_dict or {})]
        if missing:
            raise ValueError(
                f"{missing[0]!r} is mapped to 'disk' but no offload_dir was given: pass "
                "offload_dir= (a folder with room for the offloaded weights)"
            )
    weights = _weights_for(model, plan, state_dict, offload_dir, offload_index, disk)
    _install(model, plan, weights, skip_keys)
    guard_moves(model)
    model.hf_device_map = dict(device_map)
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: Iterable[str] | None = None,
) -> nn.Module:
    """Keep every weight of `model` in CPU memory and bring each module's weights to
    `execution_device` (default: where the model's first parameter is) only for its
    forward. `remove_hook_from_submodules(model)` puts them back as they were."""
    if has_hooks(model):
        remove_hook_from_submodules(model)
    device = _execution_device_of(model, execution_device)
    if state_dict is None:
        state_dict = {k: v.detach().to("cpu") for k, v in model.state_dict(keep_vars=True).items()}
    plan = _offload_all(model, device, offload_buffers, preload_module_classes)
    weights = _weights_for(model, plan, state_dict, None, None)
    _install(model, plan, weights, None)
    return model


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Iterable[str] | None = None,
) -> nn.Module:
    """Keep every weight of `model` in `offload_dir` (memory-mapped safetensors files,
    written now unless the folder has an index) and bring each module's weights to
    `execution_device` (default: where the model's first parameter is) only for its
    forward. `remove_hook_from_submodules(model)` puts them back as they were."""
    if has_hooks(model):
        remove_hook_from_submodules(model)
    device = _execution_device_of(model, execution_device)
    if not load_offload_index(offload_dir):
        offload_state_dict(offload_dir, model.state_dict())
    plan = _offload_all(model, device, offload_buffers, preload_module_classes)
    weights = _weights_for(model, plan, None, offload_dir, None)
    _install(model, plan, weights, None)
    return model


def attach_align_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Iterable[str] | None = None,
    preload_module_classes: Iterable[str] | None = None,
    tied_params_map: Any = None,
) -> None:
    """Hook `module` and its submodules to run on `execution_device` (Accelerate's function).

    Without `offload`, its weights move to `execution_device` (default: where its
    first parameter is) and each hooked forward moves its inputs there. With
    `offload`, its weights are kept on the CPU, read from `weights_map` (names as in
    the whole model, `module_name` being this module's prefix there; default: the
    module's own weights), and brought to `execution_device` for each forward only.
    `remove_hook_from_submodules(module)` puts it back as it was. Tied weights are
    found by the plan itself, so `tied_params_map` is accepted and not needed.
    """
    del tied_params_map  # ties are found from the module (tensors.tied_aliases)
    device = _execution_device_of(module, execution_device)
    if has_hooks(module):
        remove_hook_from_submodules(module)
    if not offload:
        plan = _plan(module, {"": device}, device, False, set(), offload_cpu=False)
        weights = OffloadedWeightsLoader(state_dict={})
    else:
        if weights_map is None:
            state = module.state_dict(keep_vars=True).items()
            weights_map = {name: tensor.detach().to("cpu") for name, tensor in state}
        elif module_name:
            weights_map = PrefixedDataset(weights_map, f"{module_name}.")
        plan = _offload_all(module, device, offload_buffers, preload_module_classes)
        weights = _weights_for(module, plan, weights_map, None, None)
    _install(module, plan, weights, skip_keys)


def _execution_device_of(model: nn.Module, device: int | str | torch.device | None) -> torch.device:
    """`device`, or the device of the model's first parameter (the CPU if it is on meta)."""
    if device is not None:
        return _device(device)
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta":
        return torch.device("cpu")
    return first.device


def _offload_all(
    model: nn.Module,
    device: torch.device,
    offload_buffers: bool,
    preload: Iterable[str] | None,
) -> _Plan:
    plan = _plan(model, {"": "disk"}, device, offload_buffers, set(preload or ()), True)
    plan.execution[""] = device
    return plan


class _OnDeviceWhileUsed(ModuleHook):
    """Moves the whole module to its execution device at its forward (first offloading the
    previous model of a pipeline); it stays there until `UserCpuOffloadHook.offload()`."""

    def __init__(self, device: torch.device, previous: UserCpuOffloadHook | None) -> None:
        self.execution_device = device
        self.previous = previous

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.previous is not None:
            self.previous.offload()
        first = next(module.parameters(), None)
        if first is not None and first.device != self.execution_device:
            module.to(self.execution_device)
        return send(args, self.execution_device), send(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """The handle `cpu_offload_with_hook` returns: `offload()` puts the model back in CPU
    memory, `remove()` takes the hook off (the model stays where it is)."""

    def __init__(self, model: nn.Module, hook: _OnDeviceWhileUsed) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model to the CPU (nothing to do if it is there)."""
        first = next(self.model.parameters(), None)
        if first is not None and first.device.type != "cpu":
            self.model.to("cpu")

    def remove(self) -> None:
        """Take the hook off the model."""
        remove_hook_from_module(self.model)


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep `model` in CPU memory until its forward, which moves it whole to
    `execution_device` (default: "mps", else the first GPU, else the CPU); it stays there
    until the returned hook's `offload()`. With `prev_module_hook` (the hook of the model
    run before this one), that model is offloaded when this one runs.

        encoder, hook_1 = cpu_offload_with_hook(encoder)
        decoder, hook_2 = cpu_offload_with_hook(decoder, prev_module_hook=hook_1)
        decoder(encoder(x))   # the encoder goes back to the CPU as the decoder comes in
        hook_2.offload()
    """
    if execution_device is None:
        if torch.backends.mps.is_available():
            execution_device = "mps"
        else:
            execution_device = 0 if devices.index_device_count() else "cpu"
    hook = _OnDeviceWhileUsed(_device(execution_device), prev_module_hook)
    model.to("cpu")
    add_hook_to_module(model, hook)
    return model, UserCpuOffloadHook(model, hook)
