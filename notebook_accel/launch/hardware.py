"""What the machine has, read without initialising CUDA or XLA in this process.

Forked workers cannot use CUDA if the parent initialised the driver, so every
read here goes through NVML (the management library, which is fork-safe) or
through files and environment variables.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache

import psutil


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str = "GPU"
    memory_bytes: int = 0
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Hardware:
    """A snapshot of the devices a launch can use."""

    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    tpu_cores: int = 0
    cpu_cores: int = 1
    ram_bytes: int = 0

    @property
    def accelerator(self) -> str:
        """The backend a launch picks by default: "cuda", "xla" or "cpu"."""
        if self.gpus:
            return "cuda"
        if self.tpu_cores:
            return "xla"
        return "cpu"


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset and container limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    """GPUs visible to torch, counted through NVML so CUDA stays uninitialised."""
    import torch

    if not torch.cuda._is_compiled():
        return 0
    # device_count() asks NVML first and only falls back to the CUDA runtime
    # when NVML is missing; see torch/cuda/__init__.py (device_count).
    return torch.cuda.device_count()


def detect() -> Hardware:
    """Read the machine's GPUs, TPU cores, CPU cores and memory."""
    count = cuda_device_count()
    details = {gpu.index: gpu for gpu in _nvml_gpus()} if count else {}
    visible = _visible_indices(count)
    gpus = tuple(
        GpuInfo(local, *_fields(details.get(physical))) for local, physical in enumerate(visible)
    )
    return Hardware(
        gpus=gpus,
        tpu_cores=0,  # TPU detection arrives with the XLA backend
        cpu_cores=cpu_cores(),
        ram_bytes=psutil.virtual_memory().total,
    )


def _fields(info: GpuInfo | None) -> tuple:
    if info is None:
        return ("GPU", 0, None)
    return (info.name, info.memory_bytes, info.capability)


def _visible_indices(count: int) -> list[int]:
    """Physical NVML indices of the GPUs torch will number 0..count-1."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec:
        try:
            indices = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:  # UUIDs or MIG names: keep torch's order, no details
            return [-1] * count
        return indices[:count]
    return list(range(count))


class _NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


@lru_cache(maxsize=1)
def _nvml_gpus() -> tuple[GpuInfo, ...]:
    """Name, memory and compute capability of each physical GPU, or () without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return ()
    if nvml.nvmlInit_v2() != 0:
        return ()
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return ()
        gpus = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            name = ctypes.create_string_buffer(96)
            nvml.nvmlDeviceGetName(handle, name, 96)
            memory = _NvmlMemory()
            nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
            major, minor = ctypes.c_int(), ctypes.c_int()
            ok = nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            )
            capability = (major.value, minor.value) if ok == 0 else None
            gpus.append(
                GpuInfo(index, name.value.decode(errors="replace"), memory.total, capability)
            )
        return tuple(gpus)
    finally:
        nvml.nvmlShutdown()
