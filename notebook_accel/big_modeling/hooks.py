"""dispatch_model, cpu_offload, disk_offload: a model spread over devices, run as one.

Each module that needs it gets a forward pre-hook and a forward hook (torch's own,
`register_forward_pre_hook`/`register_forward_hook`). The pre-hook moves the inputs to
the module's execution device and, for a module whose weights are offloaded (kept on
the CPU or on disk, and on the meta device in the model), brings those weights there
for this forward only; the hook puts them back on the meta device, even if the
forward raised. The model's own outputs come back on the device its inputs came from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from notebook_accel.big_modeling.device_map import check_device_map
from notebook_accel.big_modeling.memory import NAMED_DEVICES
from notebook_accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    load_offload_index,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from notebook_accel.big_modeling.tensors import tied_aliases
from notebook_accel.nested import apply_to_tensors

HOOK_ATTRIBUTE = "_notebook_accel_device_hook"
OFFLOADED = "offloaded"  # a tensor's placement: kept outside the model, loaded to run


def _send(data: Any, device: torch.device, skip_keys: Iterable[str] | None) -> Any:
    skip = set(skip_keys or ())
    if isinstance(data, Mapping) and skip:
        return type(data)({k: v if k in skip else _send(v, device, None) for k, v in data.items()})
    return apply_to_tensors(lambda t: t.to(device), data)


def _first_device(data: Any) -> torch.device | None:
    found: list[torch.device] = []
    apply_to_tensors(lambda t: found.append(t.device), data)
    return found[0] if found else None


@dataclass
class DeviceHook:
    """What runs around one module's forward.

    `execution_device`: where its inputs go and its offloaded weights are brought.
    `weights`: full tensor name -> where to read it, for the tensors this module
    loads (its own, or a whole subtree for a preloaded class). `io_same_device`: return
    the outputs on the inputs' device (the model's top module).
    """

    execution_device: torch.device
    weights: Mapping[str, torch.Tensor] | None = None
    offloaded: dict[str, str] = field(default_factory=dict)  # local name -> full name
    io_same_device: bool = False
    skip_keys: list[str] | None = None
    _input_device: torch.device | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Load the offloaded weights, move the inputs."""
        for local, full in self.offloaded.items():
            _set_tensor(module, local, self.weights[full], self.execution_device)
        if self.io_same_device:
            self._input_device = _first_device((args, kwargs))
        device = self.execution_device
        return _send(args, device, None), _send(kwargs, device, self.skip_keys)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Drop the weights loaded for this forward; outputs back to the inputs' device."""
        for local in self.offloaded:
            _set_tensor(module, local, None, torch.device("meta"))
        if self.io_same_device and self._input_device is not None:
            return _send(output, self._input_device, None)
        return output


def _set_tensor(module: nn.Module, local: str, value: torch.Tensor | None, device: torch.device):
    owner_name, _, leaf = local.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers[leaf]
    if value is None:  # back to a placeholder of the same shape and dtype, without memory
        new = old.to("meta")
    else:
        new = value.to(device)  # the dtype it was offloaded in
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(new, requires_grad=False)
    else:
        owner._buffers[leaf] = new


def add_hook_to_module(module: nn.Module, hook: DeviceHook) -> nn.Module:
    """Attach `hook` around `module`'s forward (replacing one attached before)."""
    remove_hook_from_module(module)
    before, after = hook.before, hook.after
    if "torch._dynamo" in sys.modules:
        # Under torch.compile the hooks run eagerly (a graph break) and the forward between
        # them is compiled: they read files and swap tensors, nothing a graph can hold.
        # Only when dynamo is loaded already: importing it costs seconds, and without
        # the marker dynamo breaks the graph at the file reads by itself.
        before, after = torch.compiler.disable(before), torch.compiler.disable(after)
    handles = (
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True, always_call=True),
    )
    module.__dict__[HOOK_ATTRIBUTE] = (hook, handles)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook `add_hook_to_module` attached (and those of submodules if `recurse`)."""
    for sub in module.modules() if recurse else [module]:
        attached = sub.__dict__.pop(HOOK_ATTRIBUTE, None)
        if attached is not None:
            for handle in attached[1]:
                handle.remove()
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach every hook from `module` and its submodules."""
    remove_hook_from_module(module, recurse=True)


def check_device_value(device: Any, key: str) -> None:
    """Refuse what a device map cannot hold, naming the entry."""
    if isinstance(device, torch.device):
        device = str(device)
    ok = isinstance(device, int) and not isinstance(device, bool) and device >= 0
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        ok = device in NAMED_DEVICES or (
            kind in ("cuda", "xpu", "mps", "npu", "cpu") and (not index or index.isdigit())
        )
    if not ok:
        raise ValueError(
            f"device_map[{key!r}] = {device!r} is not a device: use a GPU index (0, 1, ...), "
            "'cuda:N', 'mps', 'cpu' or 'disk'"
        )
    index = device if isinstance(device, int) else None
    if isinstance(device, str) and device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(
            f"device_map[{key!r}] = {device!r} names GPU {index}, but this machine has "
            f"{torch.cuda.device_count()} visible GPU(s): map it to an existing GPU, 'cpu' "
            "or 'disk'"
        )


def _device(value: int | str | torch.device) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value) if torch.cuda.is_available() else torch.device(value)
    return torch.device(value)


def _placement(name: str, device_map: Mapping[str, Any]) -> Any:
    """The entry of the longest key that is `name` or a module holding it."""
    best = None
    for key, value in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, value)
    if best is None:
        raise ValueError(f"the device map puts {name!r} nowhere")
    return best[1]


@dataclass
class _Plan:
    """Where each tensor goes and which modules are hooked, checked before anything moves."""

    resident: dict[str, torch.device] = field(default_factory=dict)
    offloaded: set[str] = field(default_factory=set)
    execution: dict[str, torch.device] = field(default_factory=dict)  # module -> device
    loaders: dict[str, str] = field(default_factory=dict)  # offloaded tensor -> loading module


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
    plan = _Plan()
    buffers = {name for name, _ in model.named_buffers()}
    tensors = [name for name, _ in model.named_parameters(remove_duplicate=False)] + list(buffers)
    for name in tensors:
        where = _placement(name, device_map)
        away = where == "disk" or (where == "cpu" and offload_cpu)
        if away and (offload_buffers or name not in buffers):
            plan.offloaded.add(name)
            plan.loaders[name] = _loading_module(model, name, preload)
        else:
            plan.resident[name] = main_device if away or where == "disk" else _device(where)
    # A tensor tied to a resident one stays with it (one tensor, one place).
    for name, names in tied_aliases(model).items():
        resident = [n for n in names if n in plan.resident]
        if name in plan.offloaded and resident:
            plan.offloaded.discard(name)
            plan.loaders.pop(name, None)
            plan.resident[name] = plan.resident[resident[0]]
    for key, value in device_map.items():
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
    aliases = tied_aliases(model)
    current = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name in sorted(plan.offloaded):
        source = next((n for n in aliases.get(name, [name]) if n in given or n in index), None)
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
    shared: dict[int, nn.Parameter] = {}
    for name, device in plan.resident.items():
        _move(model, name, device, shared)
    for name in plan.offloaded:
        _set_tensor(model, name, None, torch.device("meta"))
    hooks: dict[str, DeviceHook] = {
        module: DeviceHook(execution_device=device, weights=weights, skip_keys=skip)
        for module, device in plan.execution.items()
    }
    for name, module in plan.loaders.items():
        local = name[len(module) + 1 :] if module else name
        hooks[module].offloaded[local] = name
    if "" in hooks:
        hooks[""].io_same_device = True
    else:
        first = next(iter(plan.execution.values()), torch.device("cpu"))
        hooks[""] = DeviceHook(execution_device=first, io_same_device=True, skip_keys=skip)
    for module, hook in hooks.items():
        add_hook_to_module(model.get_submodule(module), hook)


def _move(model: nn.Module, name: str, device: torch.device, shared: dict[int, Any]) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        if id(old) not in shared:  # tied names get the very same new parameter
            shared[id(old)] = (
                old if old.device == device else nn.Parameter(old.to(device), old.requires_grad)
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
    where the inputs were.

    Args:
        model: the model (tensors on the meta device must be found in `state_dict`
            or the offload folder).
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
        ValueError: an unknown device, a tensor the map leaves out, a whole-model "disk"
            map, or an offloaded tensor with no weights anywhere. Nothing is moved then.
    """
    check_device_map(model, device_map)
    for key, value in device_map.items():
        check_device_value(value, key)
    devices = {str(v) for v in device_map.values()}
    if len(devices) == 1 and not force_hooks:
        only = next(iter(device_map.values()))
        if only == "disk":
            raise ValueError(
                "the whole model is mapped to 'disk': it must run somewhere; use disk_offload "
                "(which runs it on the CPU or a GPU) or give the device map some memory"
            )
        model.to(_device(only))
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
    disk = {n for n in plan.offloaded if _placement(n, device_map) == "disk"}
    if disk and offload_dir is None and offload_index is None:
        missing = [n for n in sorted(disk) if n not in (state_dict or {})]
        if missing:
            raise ValueError(
                f"{missing[0]!r} is mapped to 'disk' but no offload_dir was given: pass "
                "offload_dir= (a folder with room for the offloaded weights)"
            )
    weights = _weights_for(model, plan, state_dict, offload_dir, offload_index, disk)
    _install(model, plan, weights, skip_keys)
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
    `execution_device` (default: the first GPU, else the CPU) only for its forward."""
    device = _default_execution_device(execution_device)
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
    `execution_device` only for its forward."""
    device = _default_execution_device(execution_device)
    if not load_offload_index(offload_dir):
        offload_state_dict(offload_dir, model.state_dict())
    plan = _offload_all(model, device, offload_buffers, preload_module_classes)
    weights = _weights_for(model, plan, None, offload_dir, None)
    _install(model, plan, weights, None)
    return model


def _default_execution_device(device: int | str | torch.device | None) -> torch.device:
    if device is not None:
        return _device(device)
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _offload_all(
    model: nn.Module,
    device: torch.device,
    offload_buffers: bool,
    preload: Iterable[str] | None,
) -> _Plan:
    plan = _plan(model, {"": "disk"}, device, offload_buffers, set(preload or ()), True)
    plan.execution[""] = device
    return plan
