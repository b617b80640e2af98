"""Hooks around a module's forward: moving inputs, bringing offloaded weights in, undoing it.

A hook is attached with torch's own `register_forward_pre_hook`/`register_forward_hook`.
`DeviceHook` moves the inputs to the module's execution device and, for a module whose
weights are offloaded (kept on the CPU or on disk, and on the meta device in the model),
brings those weights there for this forward only; afterwards they are back on the meta
device, even if the forward raised. A weight tied between modules is read once per
forward of the model and shared by them (`TiedGroups`). Removing the hook puts back what
was there before it: each offloaded tensor on its device, in its dtype, a parameter of
its class with its `requires_grad`, and tensors that were tied tied again.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from notebook_accel.big_modeling.tensors import (
    _parameter_like,
    named_module_tensors,
    owner_of,
    set_module_tensor_to_device,
)
from notebook_accel.internals.tensors import to_device
from notebook_accel.training.nested import apply_to_tensors

logger = logging.getLogger(__name__)

HOOK_ATTRIBUTE = "_notebook_accel_device_hook"


def send(data: Any, device: torch.device, skip_keys: Iterable[str] | None = None) -> Any:
    """`data` (nested tensors) on `device`; the mapping entries named in `skip_keys` as they are."""
    skip = set(skip_keys or ())
    if isinstance(data, Mapping) and skip:
        return type(data)({k: v if k in skip else send(v, device) for k, v in data.items()})
    return apply_to_tensors(lambda t: t.to(device), data)


def _first_device(data: Any) -> torch.device | None:
    found: list[torch.device] = []
    apply_to_tensors(lambda t: found.append(t.device), data)
    return found[0] if found else None


class ModuleHook:
    """What runs around one module's forward; each step does nothing unless overridden."""

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Before the forward: may replace its inputs."""
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """After the forward (also when it raised): may replace its output."""
        return output

    def detach(self, module: nn.Module) -> None:
        """When the hook is removed: put back what attaching it changed."""


@dataclass(frozen=True)
class Original:
    """Where an offloaded tensor was before its hook, in what dtype (its class and
    requires_grad are kept by its meta placeholder)."""

    device: torch.device
    dtype: torch.dtype


@dataclass
class TiedGroups:
    """Offloaded names that were one parameter, shared by the hooks of one model: during a
    forward of the model each group is read from the store once and loaded once per
    device, one parameter shared by the modules that use it; removing the hooks gives
    those names one parameter again.

    A group loaded in a forward stays loaded until the model's forward ends (also when it
    raised), not until its last user in that forward ran: a module may run any number of
    times in one forward, so no earlier point is known to be its last use, and the usual
    tied pair (an embedding and the head that reads it) runs first and last anyway.
    Between forwards nothing is kept. A module called on its own, outside a forward of
    the model, reads what it needs itself.
    """

    group_of: dict[str, int] = field(default_factory=dict)  # full name -> group
    restored: dict[int, nn.Parameter] = field(default_factory=dict)
    # group -> device -> the parameter loaded there, while a forward of the model runs
    loaded: dict[int, dict[torch.device, nn.Parameter]] = field(default_factory=dict)
    forwards: int = 0  # forwards of the model running (more than one if it calls itself)

    @classmethod
    def of(cls, groups: Iterable[Iterable[str]]) -> TiedGroups:
        """From groups of full names (as `find_tied_parameters` gives)."""
        return cls({name: number for number, names in enumerate(groups) for name in names})

    def begin_forward(self) -> None:
        """A forward of the model starts: groups loaded from now on are shared."""
        self.forwards += 1

    def end_forward(self) -> None:
        """A forward of the model ends: the groups it loaded are freed (once the outermost
        one ends). Called even if the forward raised, maybe without `begin_forward` (a
        pre-hook before ours raised), hence the floor at zero."""
        self.forwards = max(self.forwards - 1, 0)
        if not self.forwards:
            self.loaded.clear()


@dataclass
class DeviceHook(ModuleHook):
    """Inputs to `execution_device`; offloaded weights brought there for each forward.

    `weights`: full tensor name -> where to read it. `offloaded`: local name -> full name,
    for the tensors this module loads (its own, or a whole subtree for a preloaded
    class). `placeholders`: the meta tensors they are between forwards. `originals`: what
    they were before offloading (those that were not on the meta device already), put
    back when the hook is removed. `io_same_device`: outputs go back to the inputs'
    device (the model's top module, whose forward is the one `ties` share weights in).
    """

    execution_device: torch.device
    weights: Mapping[str, torch.Tensor] | None = None
    offloaded: dict[str, str] = field(default_factory=dict)
    placeholders: dict[str, torch.Tensor] = field(default_factory=dict)
    originals: dict[str, Original] = field(default_factory=dict)
    ties: TiedGroups | None = None
    io_same_device: bool = False
    skip_keys: list[str] | None = None
    _input_device: torch.device | None = None

    def load(self, module: nn.Module, device: torch.device | None = None) -> None:
        """Put the offloaded weights in `module`, on `device` (default: the execution device).

        A tied weight is taken from what this forward of the model loaded already, if it
        did (see `TiedGroups`)."""
        device = self.execution_device if device is None else torch.device(device)
        ties = self.ties
        # Outside a forward of the model, tied names are still one parameter in this module.
        loaded = ties.loaded if ties is not None and ties.forwards else {}
        for local, full in self.offloaded.items():
            owner, leaf = owner_of(module, local)
            group = ties.group_of.get(full) if ties is not None else None
            if group is not None:
                owner._parameters[leaf] = self._tied(loaded.setdefault(group, {}), local, device)
                continue
            value = self.weights[full].to(device)  # in the dtype it was offloaded in
            if leaf in owner._parameters:
                owner._parameters[leaf] = _parameter_like(self.placeholders[local], value)
            else:
                owner._buffers[leaf] = value

    def _tied(
        self, copies: dict[torch.device, nn.Parameter], local: str, device: torch.device
    ) -> nn.Parameter:
        """The tied parameter `local` on `device`: from `copies` (the group's loaded
        copies), else copied from one on another device, else read from the store."""
        if device not in copies:
            source = next(iter(copies.values()), None)
            value = self.weights[self.offloaded[local]] if source is None else source.detach()
            copies[device] = _parameter_like(self.placeholders[local], value.to(device))
        return copies[device]

    def release(self, module: nn.Module) -> None:
        """Back to the meta placeholders: the loaded weights are freed."""
        for local, placeholder in self.placeholders.items():
            owner, leaf = owner_of(module, local)
            slots = owner._parameters if leaf in owner._parameters else owner._buffers
            slots[leaf] = placeholder

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Load the offloaded weights, move the inputs."""
        if self.io_same_device and self.ties is not None:
            self.ties.begin_forward()  # the model's top module: its forward starts
        self.load(module)
        if self.io_same_device:
            self._input_device = _first_device((args, kwargs))
        device = self.execution_device
        return send(args, device), send(kwargs, device, self.skip_keys)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Free the weights loaded for this forward; outputs back to the inputs' device."""
        self.release(module)
        if self.io_same_device and self.ties is not None:
            self.ties.end_forward()
        if self.io_same_device and self._input_device is not None:
            return send(output, self._input_device)
        return output

    def detach(self, module: nn.Module) -> None:
        """Each offloaded tensor as it was before offloading, read back from where it was kept."""
        for local, original in self.originals.items():
            full = self.offloaded[local]
            owner, leaf = owner_of(module, local)
            with torch.no_grad():
                value = self.weights[full].to(device=original.device, dtype=original.dtype)
            if leaf not in owner._parameters:
                owner._buffers[leaf] = value
                continue
            group = self.ties.group_of.get(full) if self.ties is not None else None
            if group is not None and group in self.ties.restored:
                owner._parameters[leaf] = self.ties.restored[group]
                continue
            parameter = _parameter_like(self.placeholders[local], value)
            owner._parameters[leaf] = parameter
            if group is not None:
                self.ties.restored[group] = parameter


def _hook_of(module: nn.Module) -> ModuleHook | None:
    attached = module.__dict__.get(HOOK_ATTRIBUTE)
    return attached[0] if attached is not None else None


def _unhook(module: nn.Module) -> ModuleHook | None:
    """Take the hook off `module`'s forward (nothing put back); returns it."""
    attached = module.__dict__.pop(HOOK_ATTRIBUTE, None)
    if attached is None:
        return None
    for handle in attached[1]:
        handle.remove()
    return attached[0]


def add_hook_to_module(module: nn.Module, hook: ModuleHook) -> nn.Module:
    """Attach `hook` around `module`'s forward, in place of a hook attached before (which is
    dropped as it is, without putting back what it changed)."""
    _unhook(module)
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
    """Detach the hook `add_hook_to_module` attached to `module` (and its submodules' if
    `recurse`), putting back what it changed: offloaded weights as they were before."""
    for sub in module.modules() if recurse else [module]:
        hook = _unhook(sub)
        if hook is not None:
            hook.detach(sub)
        for name, guard in MOVE_GUARDS.items():
            if getattr(sub.__dict__.get(name), "__func__", None) is guard:
                del sub.__dict__[name]
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach every hook from `module` and its submodules, putting back what they changed."""
    remove_hook_from_module(module, recurse=True)


def has_hooks(model: nn.Module) -> bool:
    """Whether `model` or a submodule has a hook attached."""
    return any(HOOK_ATTRIBUTE in sub.__dict__ for sub in model.modules())


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether `module`'s hook brings offloaded weights in for its forward."""
    hook = _hook_of(module)
    return isinstance(hook, DeviceHook) and bool(hook.offloaded)


def has_offloaded_weights(model: nn.Module) -> bool:
    """Whether any module of `model` has weights offloaded (on the meta device between
    forwards), so that `model.state_dict()` would hold meta tensors."""
    return any(has_offloaded_params(module) for module in model.modules())


def _guarded_move(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> nn.Module:
    """`model.to(...)`/`model.cuda(...)` of a dispatched model: refused while weights are
    offloaded (they are on the meta device), otherwise done with a warning."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise RuntimeError(
            f"model.{name}() cannot move a model whose weights are offloaded to the CPU or "
            "disk (they are on the meta device between forwards): call "
            "remove_hook_from_submodules(model) first, or dispatch it again with another map"
        )
    moves_device = name != "to" or to_device(*args, **kwargs) is not None
    if moves_device:
        logger.warning(
            "moving a model spread over devices by dispatch_model puts it all on one; its "
            "hooks still move each module's inputs to the device of the map"
        )
    return getattr(type(model), name)(model, *args, **kwargs)


def _guarded_to(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    return _guarded_move(model, "to", *args, **kwargs)


def _guarded_cuda(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    return _guarded_move(model, "cuda", *args, **kwargs)


# what dispatch_model wraps on a model it spread out
MOVE_GUARDS = {"to": _guarded_to, "cuda": _guarded_cuda}


def guard_moves(model: nn.Module) -> None:
    """Wrap `model.to` and `model.cuda` in `_guarded_move` (undone by removing the hooks).
    Bound methods, so that a deep copy of the model guards the copy."""
    for name, guard in MOVE_GUARDS.items():
        model.__dict__[name] = types.MethodType(guard, model)


@contextlib.contextmanager
def align_module_device(
    module: nn.Module, execution_device: int | str | torch.device | None = None
) -> Iterator[None]:
    """Inside, `module`'s own weights are on a device: for a module whose weights are
    offloaded, they are brought in (to its execution device, or `execution_device`) and
    freed on exit; otherwise its own parameters are moved to `execution_device`, if
    given, and back on exit."""
    hook = _hook_of(module)
    if isinstance(hook, DeviceHook) and hook.offloaded:
        hook.load(module, execution_device)
        try:
            yield
        finally:
            hook.release(module)
        return
    if execution_device is None:
        yield
        return
    devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
    for name in devices:
        set_module_tensor_to_device(module, name, execution_device)
    try:
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` on the CPU, with its offloaded weights read back (one module's
    at a time). A tensor still on the meta device (never loaded) is left out, with a warning."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        with align_module_device(module, "cpu" if has_offloaded_params(module) else None):
            for name, tensor in named_module_tensors(module, remove_non_persistent=True):
                if tensor.device.type != "meta":
                    found.setdefault(dot + name, tensor.detach().to("cpu"))
            hook = _hook_of(module)
            for local in hook.offloaded if isinstance(hook, DeviceHook) else ():
                owner, leaf = owner_of(module, local)
                loaded = owner._parameters.get(leaf, owner._buffers.get(leaf))
                found[dot + local] = loaded.detach().to("cpu")
    state: dict[str, torch.Tensor] = {}
    missing = []
    for name in model.state_dict(keep_vars=True):
        if name in found:
            state[name] = found[name]
        else:
            missing.append(name)
    if missing:
        logger.warning("left out of the state dict, still on the meta device: %s", missing)
    return state
