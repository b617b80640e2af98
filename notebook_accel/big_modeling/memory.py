"""Sizes: bytes per dtype, per module, per layer, and the memory each device may use.

Everything here reads only shapes and dtypes, so it works on a model built on the
meta device (`init_empty_weights`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from notebook_accel.big_modeling import devices

Device = int | str
# Where a device map may send a module: accelerator indices first, then these, in this order.
NAMED_DEVICES = ("mps", "cpu", "disk")

_UNITS = {
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
}
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "5GB", "1.5GiB", "200MB" ("Gb" = gigabits)."""
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a memory size cannot be negative, got {size}")
        return size
    text = str(size).strip()
    for unit, scale in _UNITS.items():
        if text.upper().endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                value = int(float(number) * scale)
            except ValueError:
                break
            if value < 0:
                raise ValueError(f"a memory size cannot be negative, got {size!r}")
            # "5Gb" (lower-case b, decimal units) means bits.
            return value // 8 if not unit.endswith("IB") and text.endswith("b") else value
    raise ValueError(
        f"memory size {size!r} is not understood: give an int (bytes) or a string with a "
        "unit such as '5GB', '1.5GiB' or '200MB'"
    )


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of `dtype` (1/8 for bool)."""
    if dtype == torch.bool:
        return 1 / 8
    if any(dtype == getattr(torch, name, None) for name in _FLOAT8):
        return 1
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"{dtype} is not a dtype with a known size")
    return int(bits.group(1)) // 8


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`torch.float16` from "float16", "torch.float16" or the dtype itself."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return found


def named_tensors(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, of `module` (shared ones once)."""
    yield from module.named_parameters(recurse=recurse)
    yield from module.named_buffers(recurse=recurse)


def stored_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` has once loaded with `dtype`: integer and bool tensors keep theirs,
    floating ones are cast down to `dtype`, never up."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    return dtype if dtype_byte_size(dtype) <= dtype_byte_size(tensor.dtype) else tensor.dtype


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> float:
    if dtype is not None and not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor.numel() * dtype_byte_size(tensor.dtype)
    if dtype is None:
        return tensor.numel() * dtype_byte_size(tensor.dtype)
    return tensor.numel() * min(dtype_byte_size(dtype), dtype_byte_size(tensor.dtype))


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, float]:
    """Bytes of every submodule and tensor by qualified name ("" is the whole model).

    `dtype` is what floating tensors will be cast to on load (never up);
    `special_dtypes` overrides it for named tensors.
    """
    dtype = as_dtype(dtype)
    special = {name: as_dtype(value) for name, value in (special_dtypes or {}).items()}
    sizes: dict[str, float] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_tensors(model)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * dtype_byte_size(special[name])
        else:
            size = _tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> float:
    """Bytes of all the buffers of `model` (sized as `compute_module_sizes` sizes them)."""
    sizes = compute_module_sizes(
        model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True
    )
    return sizes.get("", 0)


def top_level_items(model: nn.Module) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """The model's own parameters, its children, then its own buffers (the order maps follow)."""
    return (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )


def children_of(name: str, module: nn.Module) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """What a module splits into: its own parameters, then its children, by qualified name."""
    parts = list(module.named_parameters(recurse=False)) + list(module.named_children())
    return [(f"{name}.{child}", value) for child, value in parts]


def is_unsplittable(item: nn.Module | torch.Tensor, no_split: Iterable[str]) -> bool:
    """A tensor, a module without children, or one of the `no_split` classes."""
    if not isinstance(item, nn.Module):
        return True
    return not any(True for _ in item.children()) or type(item).__name__ in set(no_split)


def get_max_layer_size(
    modules: list[tuple[str, nn.Module | torch.Tensor]],
    module_sizes: Mapping[str, float],
    no_split_module_classes: Iterable[str],
) -> tuple[float, list[str]]:
    """The size of the largest layer among `modules`, and the names of the layers that size.

    A layer is a module without children, or one of `no_split_module_classes`.
    """
    no_split = set(no_split_module_classes)
    largest: float = 0
    names: list[str] = []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split:
            size = module_sizes[name]
            if size > largest:
                largest, names = size, [name]
            elif size == largest:
                names.append(name)
        else:
            pending = [(f"{name}.{child}", value) for child, value in children] + pending
    return largest, names


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one and the same tensor, e.g.
    `[["lm_head.weight", "transformer.wte.weight"]]`."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


def get_max_memory(max_memory: Mapping[Device, int | str] | None = None) -> dict[Device, int]:
    """The memory each device may use, accelerators first, then "mps", "cpu", "disk".

    None: the free memory of every accelerator device (GPUs, XPUs, ...) and the
    available RAM. Otherwise sizes are
    converted to bytes and keys are checked: an int (an accelerator index), "mps",
    "cpu" or "disk".
    """
    import psutil

    if max_memory is None:
        found: dict[Device, int] = dict(devices.free_memory_by_index())
        if torch.backends.mps.is_available():
            found["mps"] = psutil.virtual_memory().available
        else:
            found["cpu"] = psutil.virtual_memory().available
        return found
    checked: dict[Device, int] = {}
    for key, value in max_memory.items():
        check_device_name(key, what="max_memory")
        checked[key] = convert_file_size_to_int(value)
    indices = sorted(key for key in checked if isinstance(key, int))
    return {key: checked[key] for key in [*indices, *(n for n in NAMED_DEVICES if n in checked)]}


def check_device_name(device: object, what: str) -> None:
    """Refuse a device a map or a budget cannot name, saying which ones it can."""
    if isinstance(device, bool) or not (
        (isinstance(device, int) and device >= 0) or device in NAMED_DEVICES
    ):
        raise ValueError(
            f"{what} names an unknown device {device!r}: use accelerator indices (0, 1, ...), "
            f"'mps', 'cpu' or 'disk'"
        )


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Iterable[str] | str | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """A `max_memory` for `infer_auto_device_map` that spreads the model evenly over the GPUs.

    Each GPU but the last gets the model's size divided by the GPU count, plus
    room for one unsplittable block (or 1.25 times the mean size of a layer);
    `low_zero=True` keeps GPU 0 as empty as the others allow (room for `generate`).
    """
    user_set = max_memory is not None
    budget = get_max_memory(dict(max_memory) if user_set else None)
    gpus = sorted(key for key, value in budget.items() if isinstance(key, int) and value > 0)
    if not gpus:
        return budget
    if len(gpus) == 1:
        low_zero = False
        if not user_set:  # leave 10% of the only GPU for activations
            budget[gpus[0]] = int(budget[gpus[0]] * 0.9)
    no_split = _as_list(no_split_module_classes)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    per_gpu += int(1.25 * max(_largest_no_split_block(model, sizes, no_split), _mean_layer(sizes)))
    for index in gpus[:-1]:  # the last GPU keeps all it has, in case the margin is short
        cap = budget[0] if low_zero and index == 0 else per_gpu
        budget[index] = min(cap, budget[index])
    if low_zero:
        others = sum(budget[index] for index in range(1, len(gpus)))
        budget[0] = min(max(0, sizes[""] - others), budget[0])
    return budget


def _as_list(names: Iterable[str] | str | None) -> list[str]:
    if names is None:
        return []
    return [names] if isinstance(names, str) else list(names)


def _largest_no_split_block(
    model: nn.Module, sizes: Mapping[str, float], no_split: list[str]
) -> float:
    """The size of the first module found of each no-split class; the largest of those."""
    first: dict[str, float] = {}
    if not no_split:
        return 0
    for name, size in sizes.items():
        if not name:
            continue
        item = model.get_submodule(name) if _is_module_name(model, name) else None
        kind = type(item).__name__ if item is not None else None
        if kind in no_split and kind not in first:
            first[kind] = size
        if set(first) == set(no_split):
            break
    return max(first.values(), default=0)


def _is_module_name(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _leaves(names: Iterable[str]) -> list[str]:
    names = list(names)
    has_children = {name.rsplit(".", 1)[0] for name in names if "." in name}
    return [name for name in names if name and name not in has_children]


def _mean_layer(sizes: Mapping[str, float]) -> int:
    """Mean size of the innermost modules (tensors are the leaves of `sizes`; drop them)."""
    leaves = set(_leaves(sizes))
    modules = {name: size for name, size in sizes.items() if name not in leaves}
    innermost = _leaves(modules)
    return int(sum(modules[name] for name in innermost) / max(len(innermost), 1))


def calculate_maximum_sizes(model: nn.Module) -> tuple[float, tuple[float, list[str]]]:
    """The model's total size, and (size, names) of its largest layer."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    return sizes[""], get_max_layer_size(top_level_items(model), sizes, no_split)
