"""CUDA GPUs: one worker per GPU, joined by nccl.

Everything the launching process reads about GPUs goes through NVML (the
management library, which is fork-safe): a parent that initialised the CUDA
driver leaves forked workers unable to use the GPUs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from notebook_accel.internals import cuda as internal_cuda
from notebook_accel.platforms import cuda_origin
from notebook_accel.platforms.accelerator import AcceleratorPlatform
from notebook_accel.platforms.hardware import GpuInfo, Hardware, cpu_cores

# Name the line that starts CUDA in this process, should one do so before a launch.
cuda_origin.watch()


class CudaPlatform(AcceleratorPlatform):
    """One process per GPU; the kernel never touches the CUDA driver.

    The generic accelerator platform runs it; what only CUDA has stays here:
    GPUs counted and described through NVML, the watcher that names the line
    that started CUDA, compute-capability checks for bf16 and fp8, Triton for
    torch.compile, CUDA_VISIBLE_DEVICES and pinned host memory.
    """

    pins_host_memory = True

    def __init__(self) -> None:
        super().__init__("cuda")
        self.device_noun = "GPU"
        self.device_packages = cuda_origin.CUDA_LIBRARIES

    # -- the kernel's half -------------------------------------------------------

    def device_count(self, hardware: Hardware) -> int:
        return len(hardware.gpus)

    def check_available(self, hardware: Hardware) -> None:
        pass  # a launch with no GPU says so when it counts them (preflight)

    def devices_summary(self, hardware: Hardware) -> str:
        return ""

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        capabilities = [gpu.capability for gpu in hardware.gpus if gpu.capability]
        oldest = min(capabilities) if capabilities else None
        name = next((gpu.name for gpu in hardware.gpus if gpu.capability == oldest), "GPU")
        if precision == "bf16" and oldest is not None and oldest < (8, 0):
            return (
                f"bf16 needs compute capability 8.0 (Ampere) or newer; this {name} has "
                f"{oldest[0]}.{oldest[1]}; use mixed_precision='fp16'"
            )
        if precision == "fp8":
            missing = []
            if oldest is not None and oldest < (8, 9):
                missing.append(f"(this {name} has {oldest[0]}.{oldest[1]})")
            if importlib.util.find_spec("torchao") is None:
                missing.append("and the torchao package (pip install torchao)")
            if missing:
                return (
                    "fp8 needs compute capability 8.9 (Ada, Hopper) or newer "
                    + " ".join(missing)
                    + "; use mixed_precision='bf16'"
                )
        return None

    def fork_problem(self) -> str | None:
        runtime = "ROCm (HIP)" if torch.version.hip else "CUDA"
        if torch.cuda.is_initialized():
            found = cuda_origin.origin()
            where = f" ({found.describe()})" if found else ""
            return (
                f"{runtime} is already initialised in this process{where}, and a forked worker "
                "cannot use a GPU once its parent has"
            )
        if _cuda_driver_initialised():
            return (
                "the CUDA driver is already initialised in this process, by a library other "
                "than torch (or torch.cuda.is_available() with PYTORCH_NVML_BASED_CUDA_CHECK=0)"
                + _suspects(self.loaded_device_packages())
                + ", and a forked worker cannot use a GPU once its parent has"
            )
        return None

    def runtime_initialised(self) -> bool:
        return torch.cuda.is_initialized()

    def guard_runtime_start(self, refuse: Callable[[], bool]) -> Callable[[], None]:
        # torch starts CUDA through torch.cuda._lazy_init, the Python function
        # (tensor creation in C++ calls it by name too), so replacing it catches
        # a module that would start CUDA before anything has happened.
        cuda = torch.cuda
        original = internal_cuda.lazy_init(cuda)

        def lazy_init(*args: Any, **kwargs: Any) -> Any:
            if refuse():
                raise RuntimeError("it would initialise CUDA")
            return original(*args, **kwargs)

        internal_cuda.replace_lazy_init(cuda, lazy_init)

        def undo() -> None:
            if internal_cuda.lazy_init(cuda) is lazy_init:
                internal_cuda.replace_lazy_init(cuda, original)

        return undo

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        if devices is None:
            return {}
        # `devices` counts the GPUs this process sees; when CUDA_VISIBLE_DEVICES
        # already narrows them, index into that list rather than the machine's.
        # Each worker then sees its GPUs from 0: local rank r trains on cuda:r.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [name.strip() for name in visible.split(",")] if visible else None
        chosen = [names[index] if names else str(index) for index in devices]
        return {"CUDA_VISIBLE_DEVICES": ",".join(chosen)}

    # -- the worker's half -------------------------------------------------------

    def process_hardware(self) -> Hardware:
        # Inside the worker CUDA may be initialised: this is the device it uses.
        index = torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        gpu = GpuInfo(
            index,
            properties.name,
            properties.total_memory,
            (properties.major, properties.minor),
        )
        return Hardware(gpus=(gpu,), cpu_cores=cpu_cores())

    def compile_problem(self, backend: str) -> str | None:
        if backend == "inductor" and importlib.util.find_spec("triton") is None:
            return (
                "torch.compile's default backend 'inductor' generates Triton kernels for GPUs "
                "and needs the triton package (pip install triton; the CUDA builds of torch "
                "bring it); without it, use dynamo_backend='aot_eager'"
            )
        return None

    def copy_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def manual_seed(self, seed: int) -> None:
        pass  # torch.manual_seed seeds every CUDA device (lazily: CUDA is not started)


def _suspects(loaded: list[str]) -> str:
    return f"; loaded libraries that can do that: {', '.join(loaded)}" if loaded else ""


# -- counting GPUs without initialising CUDA --------------------------------------


def detect_gpus() -> tuple[GpuInfo, ...]:
    """The GPUs torch will see, numbered as torch numbers them, read through NVML."""
    count = cuda_device_count()
    details = {gpu.index: gpu for gpu in _nvml_gpus()} if count else {}
    visible = _visible_indices(count)
    return tuple(
        GpuInfo(local, *_fields(details.get(physical))) for local, physical in enumerate(visible)
    )


def cuda_device_count() -> int:
    """GPUs visible to torch, counted through NVML so CUDA stays uninitialised."""
    import torch

    if not internal_cuda.is_compiled():
        return 0
    if torch.cuda.is_initialized():  # nothing left to protect
        return torch.cuda.device_count()
    # torch.cuda.device_count() falls back to the CUDA runtime (which initialises
    # the driver, so forked workers could no longer use CUDA) when NVML cannot
    # count, as with MIG UUIDs in CUDA_VISIBLE_DEVICES. Count without it.
    count = internal_cuda.device_count_nvml()
    if count >= 0:
        return count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([name for name in visible.split(",") if name.strip()])
    return len(_nvml_gpus())


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


def _cuda_driver_initialised() -> bool:
    """True when libcuda is loaded here and cuInit has already been called.

    cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit and
    never initialises anything itself. The library is only consulted when
    something has loaded it already: loading it ourselves could do harm.
    """
    if not _library_loaded("libcuda.so"):
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) != 3


def _library_loaded(name: str) -> bool:
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            return any(name in line for line in maps)
    except OSError:
        return False
