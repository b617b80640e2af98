"""The registry of platforms: one instance per kind of device, looked up by name."""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.distributed as dist

from notebook_accel.platforms.accelerator import (
    ENV_DEVICE_PACKAGE,
    AcceleratorPlatform,
    detect_accelerators,
    device_module_of,
    import_error,
    registering_package,
)
from notebook_accel.platforms.base import DistributedType, LaunchRefused, Platform
from notebook_accel.platforms.cpu import CpuPlatform
from notebook_accel.platforms.cuda import CudaPlatform, detect_gpus
from notebook_accel.platforms.families import FAMILIES
from notebook_accel.platforms.hardware import GpuInfo, Hardware, XlaInfo, cpu_cores
from notebook_accel.platforms.mps import MpsPlatform
from notebook_accel.platforms.xla import XlaPlatform, check_tpu_in_process, detect_xla

# In the order a launch prefers them when the caller does not choose. The
# platforms of other `torch.accelerator` device types join (before the CPU) when
# first named: see `platform_named`.
PLATFORMS: dict[str, Platform] = {
    platform.name: platform for platform in (CudaPlatform(), XlaPlatform(), CpuPlatform())
}


def platform_named(name: str) -> Platform:
    """The platform called `name`: "cuda", "xla", "cpu", an accelerator family torch
    knows ("xpu", "npu", "mlu", "hpu", "musa", "sdaa", "mps"), or a device type
    registered with torch in this process (a PrivateUse1 device). Anything else is a
    ValueError that lists the choices."""
    if isinstance(name, str) and name in PLATFORMS:
        return PLATFORMS[name]
    platform = _accelerator_platform(name) if isinstance(name, str) else None
    if platform is None:
        known = [*PLATFORMS, *(family for family in FAMILIES if family not in PLATFORMS)]
        raise ValueError(
            f"backend={name!r} is no device type torch knows here; choose one of "
            f"{', '.join(known)}, a device type registered with torch, or None (this "
            "machine's default)."
        )
    cpu = PLATFORMS.pop("cpu")
    PLATFORMS[name] = platform
    PLATFORMS["cpu"] = cpu
    return platform


def _accelerator_platform(name: str) -> Platform | None:
    if name == "mps":
        return MpsPlatform()
    if name in FAMILIES:
        return AcceleratorPlatform(name)
    # A worker that starts in a fresh interpreter imports the package that
    # registers the device before torch can know it.
    package = os.environ.get(ENV_DEVICE_PACKAGE, "")
    error = import_error(package) if package else ""
    if error:
        raise RuntimeError(f"backend={name!r}: its package {package} failed to import ({error}).")
    module = device_module_of(name)
    if module is None:  # not a device type of this torch
        return None
    return AcceleratorPlatform(name, package=registering_package(module))


def offered_platforms(hardware: Hardware) -> list[str]:
    """The platforms this machine offers, the preferred first (CPU is always there)."""
    if hardware.usable_accelerators is not None:
        platform_named(hardware.usable_accelerators.device_type)
    return [name for name, platform in PLATFORMS.items() if platform.offered(hardware)]


def default_platform(hardware: Hardware) -> Platform:
    """The platform a launch uses when the caller does not choose one."""
    return platform_named(hardware.accelerator)


def known_device_packages() -> tuple[str, ...]:
    """Every package (or dotted prefix) whose import may start a device's runtime."""
    named = [package for platform in PLATFORMS.values() for package in platform.device_packages]
    families = [family.package for family in FAMILIES.values() if family.package]
    return tuple(dict.fromkeys([*named, *families]))


def platform_for_process() -> Platform:
    """The platform of a process outside any launch of ours.

    Under torchrun (or a process group the caller made) the group's backend
    says which; otherwise a GPU when one is visible, then the TPU when the
    machine has one (as Accelerate's `Accelerator()` in a TPU kernel), else the
    CPU. A TPU this process cannot use raises, saying why: a CPU run that looks
    like a TPU one is never the answer.
    """
    if dist.is_available() and dist.is_initialized():
        return _platform_of_group(dist.get_backend())
    if torch.cuda.is_available():
        return PLATFORMS["cuda"]
    tpu = tpu_of_this_machine()
    if tpu is not None:
        check_tpu_in_process(tpu)
        return PLATFORMS["xla"]
    found = detect_accelerators()
    if found is not None and found.problem:
        # Said, not silent: the person sees why their device is not used.
        warnings.warn(
            f"The {found.device_type} devices cannot be used: {found.problem}. "
            "Training on the CPU.",
            RuntimeWarning,
            stacklevel=3,
        )
    elif found is not None and found.count:
        return platform_named(found.device_type)
    return PLATFORMS["cpu"]


def _platform_of_group(backend: str) -> Platform:
    """The platform of a process group made with `backend` ("nccl", "xccl", ...;
    torch's "cpu:gloo,cuda:nccl", or "undefined" when the caller named none and torch
    chose per device)."""
    pairs = [part.split(":", 1) for part in backend.split(",") if ":" in part]
    if pairs or backend == "undefined":
        device_types = [device_type for device_type, _ in pairs] or _accelerator_types()
        for device_type in device_types:  # the device this process has
            if device_type != "cpu" and _device_available(device_type):
                return platform_named(device_type)
        return PLATFORMS["cpu"]
    for platform in PLATFORMS.values():
        if platform.process_group_backend == backend:
            return platform
    found = detect_accelerators()
    if found is not None and found.count and _backend_of(found.device_type) == backend:
        return platform_named(found.device_type)
    if backend in ("gloo", "mpi"):
        return PLATFORMS["cpu"]
    raise RuntimeError(
        f"The process group's backend {backend!r} belongs to no device this toolkit "
        "knows here; make the group with the device's backend (or gloo for the CPU)."
    )


def _accelerator_types() -> list[str]:
    found = torch.accelerator.current_accelerator()
    return [found.type] if found is not None else []


def _device_available(device_type: str) -> bool:
    module = device_module_of(device_type)
    return bool(module is not None and module.is_available())


def _backend_of(device_type: str) -> str:
    return platform_named(device_type).process_group_backend


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
        accelerators=detect_accelerators(),
    )


__all__ = [
    "PLATFORMS",
    "AcceleratorPlatform",
    "CpuPlatform",
    "CudaPlatform",
    "DistributedType",
    "GpuInfo",
    "Hardware",
    "LaunchRefused",
    "MpsPlatform",
    "Platform",
    "XlaInfo",
    "XlaPlatform",
    "default_platform",
    "detect_hardware",
    "known_device_packages",
    "offered_platforms",
    "platform_for_process",
    "platform_named",
]
