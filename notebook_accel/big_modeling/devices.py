"""What a device map's integers mean: this process's accelerator devices.

As in Accelerate, `0`, `1`, ... in a device map or a `max_memory` budget name
the devices of the accelerator torch reports here (`torch.accelerator`): CUDA
GPUs, XPUs, NPUs or an out-of-tree device alike. Counting goes through the
device's own module, which for CUDA asks NVML and starts nothing.
"""

from __future__ import annotations

import torch

from notebook_accel.platforms.accelerator import torch_accelerator


def index_device_type() -> str | None:
    """The device type integers name here ("cuda", "xpu", ...), or None when this
    process has no accelerator that takes indices (a CPU build, or Apple's one MPS)."""
    found = torch_accelerator()
    return None if found in (None, "mps") else found


def index_device_count() -> int:
    """How many devices integers may name here."""
    device_type = index_device_type()
    if device_type is None:
        return 0
    return int(torch.get_device_module(device_type).device_count())


def indexed_device(index: int) -> torch.device:
    """The device integer `index` names (the CPU where there are none)."""
    device_type = index_device_type()
    return torch.device(device_type, index) if device_type else torch.device("cpu")


def free_memory_by_index() -> dict[int, int]:
    """Free bytes of each indexed device. Reading them starts the device's runtime,
    which a model about to be put there does anyway."""
    device_type = index_device_type()
    if device_type is None:
        return {}
    module = torch.get_device_module(device_type)
    free: dict[int, int] = {}
    for index in range(index_device_count()):
        try:
            if hasattr(module, "mem_get_info"):
                free[index] = int(module.mem_get_info(index)[0])
            else:
                free[index] = int(torch.accelerator.get_memory_info(index)[0])
        except RuntimeError:  # a device that is busy or hidden: leave it out
            continue
    return free
