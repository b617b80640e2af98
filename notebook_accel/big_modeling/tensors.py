"""Putting one named tensor of a model on a device, keeping tied tensors tied."""

from __future__ import annotations

import torch
from torch import nn


def owner_of(model: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The module that directly holds `tensor_name`, and the tensor's name there."""
    module_name, _, leaf = tensor_name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise KeyError(tensor_name) from None
    if leaf not in module._parameters and leaf not in module._buffers:
        raise KeyError(tensor_name)
    return module, leaf


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
) -> None:
    """Make `tensor_name` of `module` the tensor `value` (or its current one) on `device`.

    Floating values are cast to `dtype` if given, else to the dtype the tensor had;
    a parameter stays a parameter with its `requires_grad`. Moving a meta tensor
    without a `value` is refused: there is no data to move.
    """
    owner, leaf = owner_of(module, tensor_name)
    old = owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]
    if value is None:
        if old is None or old.device.type == "meta" and str(device) != "meta":
            raise ValueError(f"{tensor_name} is on the meta device: give its value to load it")
        value = old
    if old is not None and value.shape != old.shape:
        raise ValueError(
            f"{tensor_name}: the checkpoint's shape {tuple(value.shape)} is not the model's "
            f"{tuple(old.shape)}"
        )
    target = dtype if dtype is not None else (old.dtype if old is not None else value.dtype)
    if isinstance(target, str):
        target = getattr(torch, target.replace("torch.", ""))
    if not value.is_floating_point():
        target = value.dtype
    new = value.to(device=device, dtype=target)
    if leaf in owner._parameters:
        grad = old.requires_grad if old is not None else new.is_floating_point()
        kind = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
        try:
            owner._parameters[leaf] = kind(new, requires_grad=grad and new.is_floating_point())
        except TypeError:  # a Parameter subclass with its own constructor
            owner._parameters[leaf] = nn.Parameter(new, requires_grad=grad)
    else:
        owner._buffers[leaf] = new


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each tied tensor name -> every name of the same tensor (itself included)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() if len(names) > 1 for name in names}
