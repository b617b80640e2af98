"""The registry of platforms: one class per kind of device, looked up by name.

A launch plan and a worker's environment carry only a platform's name; both
the launching process and the worker find the same class here. Every
`torch.accelerator` device type (XPU, NPU, MLU, HPU, MUSA, SDAA, an
out-of-tree PrivateUse1 device, and CUDA itself) runs on one generic platform;
a new device family is a row in families.py.

    registry.py     PLATFORMS and the lookups (imported on first use of a name from here,
                    so that cuda_origin, imported by `import notebook_accel`, stays light)
    base.py         what every platform answers
    accelerator.py  the platform of every torch.accelerator device type, and their detection
    families.py     what differs between device families (backend, package, precisions)
    cpu.py, cuda.py, mps.py, xla.py  the other platforms and the subclasses
    hardware.py     what a machine has
    collectives.py  a platform's primitive collectives
    cuda_origin.py  which line started CUDA in this process (the kernel's half)
    probes.py       Accelerate's is_*_available, answered without importing packages

May import: config.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("notebook_accel.platforms.registry"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
