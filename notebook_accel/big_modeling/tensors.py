"""One named tensor of a model: listing, moving, and keeping tied tensors tied."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from notebook_accel.big_modeling import devices


def owner_of(model: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The module that directly holds `tensor_name`, and the tensor's name there."""
    module_name, _, leaf = tensor_name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no submodule {module_name!r}") from None
    if leaf not in module._parameters and leaf not in module._buffers:
        raise ValueError(
            f"{type(module).__name__} {module_name or '(the model)'} has no parameter or buffer "
            f"named {leaf!r}"
        )
    return module, leaf


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype


def _keeps_its_dtype(tensor: torch.Tensor) -> bool:
    """Integer and bool tensors are never cast to a floating `dtype` on load."""
    return not (tensor.is_floating_point() or tensor.is_complex())


def _parameter_like(old: nn.Parameter | None, value: torch.Tensor) -> nn.Parameter:
    """`value` as a parameter of `old`'s class, with `old`'s requires_grad."""
    grad = old.requires_grad if old is not None else True
    grad = grad and not _keeps_its_dtype(value)  # autograd refuses integer leaves
    kind = type(old) if isinstance(old, nn.Parameter) else nn.Parameter
    try:
        return kind(value, requires_grad=grad)
    except TypeError:  # a Parameter subclass with its own constructor
        return nn.Parameter(value, requires_grad=grad)


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: int | str | torch.device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
) -> None:
    """Make `tensor_name` of `module` the tensor `value` (or its current one) on `device`.

    `value` is cast to `dtype` if given (integer and bool values keep theirs), else to
    the dtype the tensor had; a parameter stays a parameter of its class with its
    `requires_grad`. Moving a meta tensor without a `value` is refused: there is no data
    to move. A tensor already on `device` in the dtype asked is left as it is (the same
    object, so what is tied to it stays tied).
    """
    owner, leaf = owner_of(module, tensor_name)
    old = owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]
    if value is None:
        if old is None or old.device.type == "meta" and str(device) != "meta":
            raise ValueError(f"{tensor_name} is on the meta device: give its value to load it")
        value = old
    elif old is not None and value.shape != old.shape:
        # Accelerate's wording, which code written for it may match on.
        raise ValueError(
            f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has shape '
            f"{old.shape}), this looks incorrect."
        )
    if dtype is not None:
        target = value.dtype if _keeps_its_dtype(value) else _as_dtype(dtype)
    else:
        target = old.dtype if old is not None else value.dtype
    if isinstance(device, int):
        device = devices.indexed_device(device)
    if value is old and old.device == torch.device(device) and old.dtype == target:
        return
    with torch.no_grad():
        new = value.to(device=device, dtype=target)
    if leaf in owner._parameters:
        owner._parameters[leaf] = _parameter_like(old, new)
    else:
        owner._buffers[leaf] = new


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of `module`, then its buffers (`include_buffers`), by name.

    `recurse=False` (the default): only its own, not its submodules'.
    `remove_non_persistent`: leave out the buffers a state dict leaves out.
    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    skipped = (
        get_non_persistent_buffers(module, recurse=recurse, fqns=True)
        if remove_non_persistent
        else set()
    )
    for name, buffer in module.named_buffers(recurse=recurse):
        if name not in skipped:
            yield name, buffer


def get_non_persistent_buffers(
    module: nn.Module, recurse: bool = False, fqns: bool = False
) -> set[str]:
    """Names of the buffers of `module` that its state dict leaves out (a new set).

    With `recurse`, those of its submodules too: by their own name, or by their name
    in `module` with `fqns=True`.
    """
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, sub in module.named_modules():
            if prefix:
                found |= {f"{prefix}.{b}" if fqns else b for b in sub._non_persistent_buffers_set}
    return found


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each tied tensor name -> every name of the same tensor (itself included)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() if len(names) > 1 for name in names}


def retie_parameters(model: nn.Module, tied_params: Iterable[Iterable[str]]) -> None:
    """Make each group of names (as `find_tied_parameters` gives) one parameter again: the
    first of the group that is not on the meta device (a group all on meta is left)."""
    for group in tied_params:
        names = list(group)
        placed = [owner_of(model, name) for name in names]
        shared = next(
            (
                owner._parameters[leaf]
                for owner, leaf in placed
                if owner._parameters[leaf].device.type != "meta"
            ),
            None,
        )
        if shared is None:
            continue
        for owner, leaf in placed:
            owner._parameters[leaf] = shared
