"""infer_auto_device_map: which device each part of a model lives on.

GPUs are filled in order, then the CPU, then the disk. While anything may still be
offloaded, the first GPU (or the CPU, on a machine without one) keeps room for the
largest layer, since an offloaded layer is brought there to run. A module that
does not fit is split into its parameters and children, unless it is a tensor, has
no children, or is one of `no_split_module_classes` (a block with a residual
connection, say); then it goes to the next device. Tied parameters are placed
together. For the same inputs the map equals Accelerate's.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from notebook_accel.big_modeling.memory import (
    Device,
    _as_list,
    children_of,
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
    is_unsplittable,
    top_level_items,
)

logger = logging.getLogger(__name__)

Item = tuple[str, "nn.Module | torch.Tensor"]


def _inside(module_name: str, tensor_name: str) -> bool:
    # The dots make "h.1" not contain "h.10.weight".
    return module_name + "." in tensor_name + "."


def format_bytes(size: float) -> str:
    """`1536` -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@dataclass
class _Planner:
    """The state of one pass over the model; `run` returns the map."""

    model: nn.Module
    budget: dict[Device, int]
    no_split: list[str]
    sizes: Mapping[str, float]
    ties: list[list[str]]
    fallback: bool
    verbose: bool = False
    offload_buffers: bool = False
    buffer_sizes: Mapping[str, float] = field(default_factory=dict)
    devices: list[Device] = field(init=False)
    reserving: list[Device] = field(init=False)
    queue: list[Item] = field(init=False)
    used: dict[Device, float] = field(init=False)
    largest: float = field(init=False)
    largest_names: list[str] = field(init=False)
    device_map: OrderedDict = field(default_factory=OrderedDict)
    index: int = 0
    # bytes of buffers of the modules placed on each device (they stay in memory when
    # their module is offloaded, unless offload_buffers)
    placed_buffers: dict[Device, float] = field(default_factory=dict)
    # what a device that was left empty would have needed for the module it could not take
    needed: dict[Device, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = list(self.budget) + ([] if "disk" in self.budget else ["disk"])
        accelerators = [d for d in self.devices if d not in ("cpu", "disk")]
        if "mps" in accelerators:
            self.reserving = ["mps"]
        else:
            self.reserving = [accelerators[0], "cpu"] if accelerators else ["cpu"]
        self.queue = top_level_items(self.model)
        self.used = dict.fromkeys(self.devices, 0)
        self.largest, self.largest_names = get_max_layer_size(self.queue, self.sizes, self.no_split)

    def _remeasure_largest(self) -> None:
        modules = [(n, m) for n, m in self.queue if isinstance(m, nn.Module)]
        self.largest, self.largest_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _tied_outside(self, name: str) -> list[str]:
        """Tensors tied to one inside `name` that live outside it."""
        groups = [
            group
            for group in self.ties
            if any(_inside(name, t) for t in group) and not all(_inside(name, t) for t in group)
        ]
        return [t for group in groups for t in group if not _inside(name, t)]

    def _with_ties(self, tied: list[str], size: float) -> tuple[float, list[Item]]:
        """`size` plus the queued modules holding the `tied` tensors, and those modules."""
        total, names, modules = get_module_size_with_ties(tied, size, self.sizes, self.queue)
        return total, list(zip(names, modules, strict=True))

    def _limit(self, device: Device) -> tuple[float | None, float]:
        """What `device` may still take in all, and what it keeps for an offloaded layer."""
        if device == "disk":
            return None, 0
        if device in self.reserving:
            return self.budget[device] - self.largest, self.largest
        return self.budget[device], 0

    def _place(self, item: Item, device: Device, size: float, holders: list[Item]) -> None:
        name, module = item
        if self.verbose:
            tied = f" with {[h for h, _ in holders]}" if holders else ""
            print(f"{name}{tied} ({format_bytes(size)}) -> {device}")
        self.used[device] += size
        self.device_map[name] = device
        if isinstance(module, nn.Module) and not self.offload_buffers:
            buffers = self.buffer_sizes.get(name, 0)
            self.placed_buffers[device] = self.placed_buffers.get(device, 0) + buffers
        for holder, _ in holders:
            self.queue = [(n, m) for n, m in self.queue if n != holder]
            self.device_map[holder] = device

    def _split_a_holder(self, item: Item, holders: list[Item]) -> bool:
        for holder, module in holders:
            if is_unsplittable(module, self.no_split):
                continue
            at = next(i for i, (n, _) in enumerate(self.queue) if n == holder)
            self.queue = [
                item,
                *self.queue[:at],
                *children_of(holder, module),
                *self.queue[at + 1 :],
            ]
            self._remeasure_largest()
            return True
        return False

    def run(self) -> OrderedDict:
        while self.queue:
            self._step(self.queue.pop(0))
        self._warn_if_buffers_fit_no_gpu()
        if self.needed:
            needs = ", ".join(f"{d}: {format_bytes(n)}" for d, n in self.needed.items())
            logger.info(
                "no module could be placed on some devices (insufficient memory); the first "
                "module each was offered needed at least %s",
                needs,
            )
        return self.device_map

    def _warn_if_buffers_fit_no_gpu(self) -> None:
        """Buffers of offloaded modules live on a GPU; say so if they fit on none."""
        offloaded = self.placed_buffers.get("cpu", 0) + self.placed_buffers.get("disk", 0)
        gpus = [d for d in self.devices if d not in ("cpu", "disk")]
        if self.offload_buffers or offloaded <= 0 or not gpus:
            return
        if any(self.budget[gpu] >= offloaded + self.used[gpu] for gpu in gpus):
            return
        warnings.warn(
            f"the buffers of the modules offloaded to the CPU or disk ({format_bytes(offloaded)}) "
            "are kept on the GPU that runs them, and fit in what is left on none; if it runs "
            "out of memory, pass offload_buffers=True (they are then loaded with their module)",
            UserWarning,
            stacklevel=3,
        )

    def _step(self, item: Item) -> None:  # noqa: C901  (one decision, read top to bottom)
        name, module = item
        self.largest_names = [
            n for n in self.largest_names if n != name and not n.startswith(name + ".")
        ]
        if not self.largest_names:
            self._remeasure_largest()
        size = self.sizes[name]
        tied = self._tied_outside(name)
        device = self.devices[self.index]
        limit, reserved = self._limit(device)
        size_with_ties, holders = self._with_ties(tied, size)

        if limit is None or self.used[device] + size_with_ties <= limit:
            self._place(item, device, size_with_ties, holders)
            return
        # The module fits but not with what it is tied to: split one of those.
        if tied and self.used[device] + size <= limit and self._split_a_holder(item, holders):
            return
        if self.used[device] + size >= limit and not is_unsplittable(module, self.no_split):
            self.queue = children_of(name, module) + self.queue
            self._remeasure_largest()
            return
        if (
            self.fallback
            and self.used[device] == 0
            and self._fallback(item, device, size_with_ties)
        ):
            return
        if self.used[device] == 0:
            self.needed[device] = size_with_ties + reserved
        # Next device; the one left keeps the room it reserved.
        self.used[device] += reserved
        self.index += 1
        self.queue.insert(0, item)

    def _fallback(self, item: Item, device: Device, size_with_ties: float) -> bool:
        """Put the first module found (breadth first) that fits on the empty `device` first."""
        limit = self.budget[device] - max(self.largest, size_with_ties)
        found = _first_that_fits(self.queue, self.sizes, limit, self.no_split, self.ties)
        if found is None:
            return False
        fitting, rest = found
        self.queue = [fitting, item, *rest]
        return True


def get_module_size_with_ties(
    tied_params: list[str],
    module_size: float,
    module_sizes: Mapping[str, float],
    modules_to_treat: list[Item],
) -> tuple[float, list[str], list[nn.Module | torch.Tensor]]:
    """A module's size with the modules holding the tensors tied to it (`tied_params`, the
    tied tensors outside it), found among `modules_to_treat`: (size, their names, them).

    A holder counts in full, less the tied tensor already counted in `module_size`. A tied
    tensor no queued module holds (placed already) adds nothing.
    """
    total = module_size
    names: list[str] = []
    modules: list[nn.Module | torch.Tensor] = []
    for tensor in tied_params:
        holder = next(((n, m) for n, m in modules_to_treat if tensor.startswith(n + ".")), None)
        if holder is None:
            continue
        names.append(holder[0])
        modules.append(holder[1])
        total += module_sizes[holder[0]] - module_sizes[tensor]
    return total, names, modules


def _first_that_fits(
    queue: list[Item],
    sizes: Mapping[str, float],
    limit: float,
    no_split: list[str],
    ties: list[list[str]],
) -> tuple[Item, list[Item]] | None:
    """The first queued module or part of one (breadth first) of at most `limit` bytes, with
    the queue it leaves (its parents replaced by their parts)."""
    if limit < 0:
        return None
    search = list(queue)
    chosen: Item | None = None
    while search:
        name, module = search.pop(0)
        groups = [g for g in ties if any(_inside(name, t) for t in g)]
        groups = [g for g in groups if not all(_inside(name, t) for t in g)]
        tied = [t for g in groups for t in g if not _inside(name, t)]
        size, _, _ = get_module_size_with_ties(tied, sizes[name], sizes, search)
        if size <= limit:
            chosen = (name, module)
            break
        if not is_unsplittable(module, no_split):
            search = children_of(name, module) + search
    if chosen is None:
        return None
    rest = list(queue)
    parts = chosen[0].split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        at = next((i for i, (n, _) in enumerate(rest) if n == parent), None)
        if at is not None:
            rest = rest[:at] + children_of(parent, rest[at][1]) + rest[at + 1 :]
    rest = [(n, m) for n, m in rest if n != chosen[0]]
    return chosen, rest


def _check_largest_layer_fits(
    model: nn.Module, budget: Mapping[Device, int], sizes: Mapping[str, float], no_split: list[str]
) -> None:
    """An offloaded layer runs in memory: refuse a budget where no device can hold the largest."""
    memory = {device: size for device, size in budget.items() if device != "disk"}
    largest, names = get_max_layer_size(top_level_items(model), sizes, no_split)
    if largest and all(size < largest for size in memory.values()):
        where = ", ".join(f"{d!r}: {format_bytes(s)}" for d, s in memory.items()) or "none"
        raise ValueError(
            f"max_memory ({where}) is below the largest layer, {names[0]!r} "
            f"({format_bytes(largest)}), which must fit in memory to run even when offloaded "
            f"to disk: give 'cpu' (or a GPU) at least {format_bytes(largest)}, or let that "
            "layer be split (leave its class out of no_split_module_classes)."
        )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Iterable[str] | str | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    strict: bool = False,
) -> OrderedDict:
    """A device map for `model` (module name -> GPU index, "cpu" or "disk") within `max_memory`.

    Args:
        model: the model; on the meta device is fine (only sizes are read).
        max_memory: bytes (or "10GB"-style strings) per device: GPU indices, "mps",
            "cpu", "disk". Default: what is free on each GPU and in RAM.
        no_split_module_classes: class names of blocks never split across devices.
        dtype: what floating weights will be cast to when loaded (sizes follow it).
        special_dtypes: per-tensor dtypes that override `dtype`.
        verbose: print each placement.
        clean_result: merge children that share a device into their parent's entry.
        offload_buffers: whether the buffers of offloaded modules will be offloaded with
            them; if not (the default), they stay on the GPU that runs them, and a warning
            says when they fit on no GPU.
        fallback_allocation: when a device would stay empty, fill it with the first
            module (breadth first) that fits.
        strict: refuse a `max_memory` in which no device holds the largest layer (by
            default, as Accelerate does, what fits nowhere goes to "disk", and the device
            left empty is logged).

    Raises:
        ValueError: a device name that is not a GPU index, "mps", "cpu" or "disk"; with
            `strict`, a `max_memory` where no device can hold the largest layer.
    """
    no_split = _as_list(no_split_module_classes)
    budget = get_max_memory(dict(max_memory) if max_memory is not None else None)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    if strict:
        _check_largest_layer_fits(model, budget, sizes, no_split)
    planner = _Planner(
        model=model,
        budget=budget,
        no_split=no_split,
        sizes=sizes,
        ties=find_tied_parameters(model),
        fallback=fallback_allocation,
        verbose=verbose,
        offload_buffers=offload_buffers,
        buffer_sizes=(
            # only read for the warning about buffers kept on a GPU
            compute_module_sizes(
                model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True
            )
            if not offload_buffers and any(d not in ("cpu", "disk") for d in budget)
            else {}
        ),
    )
    device_map = planner.run()
    return clean_device_map(device_map) if clean_result else device_map


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Replace the entries under a module by one for the module where they share a device
    (recursively, from the top). The merged entry takes the place of the first it replaces."""
    prefix = f"{module_name}." if module_name else ""
    under = [key for key in device_map if key.startswith(prefix)]
    values = {device_map[key] for key in under}
    if len(values) == 1 and len(under) > 1:
        merged = OrderedDict()
        for key, value in device_map.items():
            if key in under:
                merged.setdefault(module_name, value)
            else:
                merged[key] = value
        device_map.clear()
        device_map.update(merged)
        return device_map
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = []
    for key in under:
        if len(key) > len(module_name):
            child = ".".join(key.split(".")[:depth])
            if child not in children:
                children.append(child)
    for child in children:
        clean_device_map(device_map, child)
    return device_map


def state_dict_names(model: nn.Module) -> list[str]:
    """The names `model.state_dict()` has, in its order: every name of each parameter (tied
    ones too), and the persistent buffers. One walk over the modules, no tensor touched."""
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names += [dot + name for name, p in module._parameters.items() if p is not None]
        names += [
            dot + name
            for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set
        ]
    return names


def check_device_map(
    model: nn.Module, device_map: Mapping[str, Device], strict: bool = False
) -> None:
    """Refuse a map that leaves a tensor of `model`'s state dict without a device, and warn
    about keys that name nothing in `model` (`strict=True`: refuse those too)."""
    modules = {name for name, _ in model.named_modules()}
    tensors = state_dict_names(model)
    known = modules | set(tensors) | {name for name, _ in model.named_buffers()}
    unknown = [key for key in device_map if key not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known - {""}), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        message = (
            f"these device_map keys do not match any submodules or tensors of the model: "
            f"{', '.join(hints)}"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message + "; they are ignored", UserWarning, stacklevel=2)
    if "" in device_map:
        return
    for name in tensors:
        parts = name.split(".")
        if not any(".".join(parts[:depth]) in device_map for depth in range(1, len(parts) + 1)):
            raise ValueError(
                f"the device map puts {name!r} nowhere: add an entry for it or a module holding it"
            )
