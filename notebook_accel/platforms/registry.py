"""The registry of platforms: one instance per kind of device, looked up by name."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from notebook_accel.platforms.base import DistributedType, LaunchRefused, Platform
from notebook_accel.platforms.cpu import CpuPlatform
from notebook_accel.platforms.cuda import CudaPlatform, detect_gpus
from notebook_accel.platforms.hardware import GpuInfo, Hardware, XlaInfo, cpu_cores
from notebook_accel.platforms.xla import XlaPlatform, check_tpu_in_process, detect_xla

# In the order a launch prefers them when the caller does not choose.
PLATFORMS: dict[str, Platform] = {
    platform.name: platform for platform in (CudaPlatform(), XlaPlatform(), CpuPlatform())
}


def platform_named(name: str) -> Platform:
    """The platform called `name`, or a ValueError that lists the choices."""
    try:
        return PLATFORMS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"backend={name!r} must be one of {', '.join(sorted(PLATFORMS))} (or None)."
        ) from None


def offered_platforms(hardware: Hardware) -> list[str]:
    """The platforms this machine offers, the preferred first (CPU is always there)."""
    return [name for name, platform in PLATFORMS.items() if platform.offered(hardware)]


def default_platform(hardware: Hardware) -> Platform:
    """The platform a launch uses when the caller does not choose one."""
    return PLATFORMS[hardware.accelerator]


def platform_for_process() -> Platform:
    """The platform of a process outside any launch of ours.

    Under torchrun (or a process group the caller made) the group's backend
    says which; otherwise a GPU when one is visible, then the TPU when the
    machine has one (as Accelerate's `Accelerator()` in a TPU kernel), else the
    CPU. A TPU this process cannot use raises, saying why: a CPU run that looks
    like a TPU one is never the answer.
    """
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        for platform in PLATFORMS.values():
            if platform.process_group_backend == backend:
                return platform
        return PLATFORMS["cpu"]
    if torch.cuda.is_available():
        return PLATFORMS["cuda"]
    tpu = tpu_of_this_machine()
    if tpu is not None:
        check_tpu_in_process(tpu)
        return PLATFORMS["xla"]
    return PLATFORMS["cpu"]


@functools.cache
def tpu_of_this_machine() -> XlaInfo | None:
    """The TPU this machine has, or None (XLA's CPU device does not count: it is opt-in).

    Read once per process: every `PartialState()` asks, and the chips do not change.
    """
    info = detect_xla(os.environ)
    return info if info is not None and info.device_type == "TPU" else None


def detect_hardware() -> Hardware:
    """Read the machine's GPUs, TPU cores, CPU cores and memory, initialising nothing."""
    import psutil  # here: a worker's Accelerator() never needs it

    xla = detect_xla(os.environ)
    return Hardware(
        gpus=detect_gpus(),
        tpu_cores=xla.devices if xla and xla.device_type == "TPU" else 0,
        xla=xla,
        cpu_cores=cpu_cores(),
        ram_bytes=psutil.virtual_memory().total,
    )


__all__ = [
    "PLATFORMS",
    "CpuPlatform",
    "CudaPlatform",
    "DistributedType",
    "GpuInfo",
    "Hardware",
    "LaunchRefused",
    "Platform",
    "XlaInfo",
    "XlaPlatform",
    "default_platform",
    "detect_hardware",
    "offered_platforms",
    "platform_for_process",
    "platform_named",
]
