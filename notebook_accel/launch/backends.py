"""One class per kind of device a launch can run on.

A backend answers the few questions where devices differ: how many workers
the machine can take, which precisions it can run, whether this process is
still safe to fork from, and what a worker sets up before the user's code.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

from notebook_accel.launch.hardware import Hardware


class LaunchRefused(RuntimeError):
    """The kernel is in a state that forked workers cannot run from."""


class Backend:
    name: str = ""
    process_group_backend: str = ""
    device_noun: str = "device"

    def device_count(self, hardware: Hardware) -> int:
        raise NotImplementedError

    def default_num_processes(self, hardware: Hardware) -> int:
        return self.device_count(hardware)

    def oversubscription_allowed(self) -> bool:
        """Whether more workers than devices is a warning rather than an error."""
        return False

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        """Why `precision` cannot run here, or None when it can."""
        return None

    def check_parent_is_clean(self) -> None:
        """Raise LaunchRefused if this process can no longer fork working workers."""

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        """Extra environment variables for one worker."""
        return {}


class CpuBackend(Backend):
    name = "cpu"
    process_group_backend = "gloo"
    device_noun = "CPU core"

    def device_count(self, hardware: Hardware) -> int:
        return hardware.cpu_cores

    def default_num_processes(self, hardware: Hardware) -> int:
        # Two workers show data parallelism at work without crowding a laptop.
        return min(2, hardware.cpu_cores)

    def oversubscription_allowed(self) -> bool:
        return True

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        if precision == "fp8":
            return "fp8 needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper)"
        return None


class CudaBackend(Backend):
    name = "cuda"
    process_group_backend = "nccl"
    device_noun = "GPU"

    def device_count(self, hardware: Hardware) -> int:
        return len(hardware.gpus)

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        capabilities = [gpu.capability for gpu in hardware.gpus if gpu.capability]
        oldest = min(capabilities) if capabilities else None
        if precision == "bf16" and oldest is not None and oldest < (8, 0):
            return f"bf16 needs compute capability 8.0 (Ampere) or newer; this GPU has {oldest}"
        if precision == "fp8":
            if oldest is not None and oldest < (8, 9):
                return (
                    "fp8 needs compute capability 8.9 (Ada, Hopper) or newer; "
                    f"this GPU has {oldest}"
                )
            if importlib.util.find_spec("torchao") is None:
                return "fp8 training needs torchao: pip install torchao"
        return None

    def check_parent_is_clean(self) -> None:
        import torch

        if torch.cuda.is_initialized():
            raise LaunchRefused(
                "CUDA is already initialised in this kernel, so forked workers cannot "
                "use the GPUs. A cell touched a GPU before the launch (for example "
                "model.to('cuda'), torch.cuda.get_device_name() or a tensor on 'cuda'). "
                "Restart the kernel and run the cells in order, creating models and "
                "tensors on the GPU only inside the training function."
            )
        if _cuda_driver_initialised():
            raise LaunchRefused(
                "The CUDA driver is already initialised in this kernel (by a library "
                "other than torch, or torch.cuda.is_available() with "
                "PYTORCH_NVML_BASED_CUDA_CHECK=0), so forked workers cannot use the GPUs. "
                "Restart the kernel and launch before anything touches CUDA."
            )

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        if devices is None:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in devices)}


class XlaBackend(Backend):
    name = "xla"
    process_group_backend = "xla"
    device_noun = "TPU core"

    def device_count(self, hardware: Hardware) -> int:
        return hardware.tpu_cores

    def check_parent_is_clean(self) -> None:
        raise LaunchRefused(
            "Launching on TPU cores is not available in this version of notebook_accel; "
            "pass backend='cpu' to run on CPU workers."
        )


BACKENDS: dict[str, Backend] = {
    backend.name: backend for backend in (CpuBackend(), CudaBackend(), XlaBackend())
}


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
