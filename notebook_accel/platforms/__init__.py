"""The registry of platforms: one class per kind of device, looked up by name.

A launch plan and a worker's environment carry only a platform's name; both
the launching process and the worker find the same class here. A new device
(Apple MPS, Intel XPU) is one new module with a `Platform` subclass and one
line in `PLATFORMS`.

    registry.py     PLATFORMS and the lookups (imported on first use of a name from here,
                    so that cuda_origin, imported by `import notebook_accel`, stays light)
    base.py, cpu.py, cuda.py, xla.py  the platforms; hardware.py: what a machine has
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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("notebook_accel.platforms.registry"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
