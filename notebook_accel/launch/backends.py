"""One class per kind of device a launch can run on.

A backend answers the few questions where devices differ: how many workers
the machine can take, which precisions it can run, whether this process is
still safe to fork from, and what a worker sets up before the user's code.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from notebook_accel.launch import xla
from notebook_accel.launch.hardware import Hardware, colab_tpu_node


class LaunchRefused(RuntimeError):
    """The kernel is in a state that forked workers cannot run from."""


class Backend:
    name: str = ""
    process_group_backend: str = ""
    device_noun: str = "device"
    # num_processes=1 runs the function in the launching process itself.
    single_worker_in_process: bool = True
    supports_multinode: bool = True

    def device_count(self, hardware: Hardware) -> int:
        raise NotImplementedError

    def check_available(self, hardware: Hardware) -> None:
        """Raise if this backend cannot run on this machine at all."""

    def worker_processes(self, num_processes: int, hardware: Hardware) -> int:
        """How many worker processes run `num_processes` devices (raise if none can)."""
        return num_processes

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

    def run_in_worker(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        local_rank: int,
        local_world_size: int,
    ) -> Any:
        """Call the user's function inside a forked worker; return its value."""
        return function(*args, **kwargs)


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
        # `devices` counts the GPUs this process sees; when CUDA_VISIBLE_DEVICES
        # already narrows them, index into that list rather than the machine's.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [name.strip() for name in visible.split(",")] if visible else None
        chosen = [names[index] if names else str(index) for index in devices]
        return {"CUDA_VISIBLE_DEVICES": ",".join(chosen)}


class XlaBackend(Backend):
    """TPU cores through torch_xla/PJRT; the worker side lives in launch/xla.py."""

    name = "xla"
    process_group_backend = "xla"
    device_noun = "TPU core"
    # In the kernel itself the function would start the XLA runtime there, and
    # a started runtime cannot be stopped: every later launch would be refused
    # until a restart. So one worker is forked too.
    single_worker_in_process = False
    supports_multinode = False

    def device_count(self, hardware: Hardware) -> int:
        return hardware.xla.devices if hardware.xla else 0

    def check_available(self, hardware: Hardware) -> None:
        if hardware.xla is None:
            if colab_tpu_node(os.environ):
                reason = (
                    "this Colab runtime is a TPU Node (COLAB_TPU_ADDR), which PJRT cannot "
                    "use; choose a TPU runtime of the TPU VM kind (Runtime > Change runtime "
                    "type: v2-8, v5e-1 or v6e-1)"
                )
            else:
                reason = (
                    "no TPU chips were found (PCI ids, /dev/accel*, /dev/vfio) and "
                    "PJRT_DEVICE is not CPU; to try the XLA backend on this CPU, set "
                    "PJRT_DEVICE=CPU before launching"
                )
            raise RuntimeError(f"backend='xla' cannot run here: {reason}.")
        if importlib.util.find_spec("torch_xla") is None:
            raise ImportError(
                f"backend='xla' needs torch_xla, which is not installed: {xla.INSTALL_HINT}."
            )
        if hardware.xla.missing:
            raise RuntimeError(
                f"backend='xla' found {hardware.xla.devices} TPU core(s) but not "
                f"{hardware.xla.missing}."
            )

    def worker_processes(self, num_processes: int, hardware: Hardware) -> int:
        info = hardware.xla
        assert info is not None  # check_available came first
        if num_processes == 1:
            return 1
        if info.device_type == "CPU":
            # torch_xla 2.9 runs the CPU client's devices as threads of one process,
            # and there its collectives deadlock (the threads reach different op ids).
            raise ValueError(
                f"num_processes={num_processes} on XLA's CPU device would run "
                f"{num_processes} devices as threads of one process, where torch_xla's "
                "collectives deadlock. Use num_processes=1 (CPU_NUM_DEVICES=1) to try "
                "XLA on the CPU, or backend='cpu' for several CPU workers."
            )
        if num_processes != info.devices:
            # xmp.spawn accepts nprocs=1 or all devices and nothing between.
            raise ValueError(
                f"num_processes={num_processes}: torch_xla runs either one TPU core or all "
                f"{info.devices} of this host (one process per chip). Pass "
                f"num_processes={info.devices} or 1."
            )
        return info.processes

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        if precision == "fp16":
            return "TPUs compute in bfloat16, not float16; use mixed_precision='bf16'"
        if precision == "fp8":
            return "fp8 needs a CUDA GPU of compute capability 8.9 or newer; on TPUs use bf16"
        return None

    def check_parent_is_clean(self) -> None:
        if xla.runtime_initialized_here():
            raise LaunchRefused(
                "The XLA runtime is already initialised in this kernel, so forked workers "
                "cannot use the TPU. A cell touched an XLA device before the launch (for "
                "example torch_xla.device(), xm.xla_device(), model.to('xla') or "
                "xr.world_size()). Restart the kernel and run the cells in order, creating "
                "models and tensors on the XLA device only inside the training function."
            )

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        # Said outright, so torch_xla does not guess (and warn) in every worker.
        return {"PJRT_DEVICE": os.environ.get("PJRT_DEVICE") or "TPU"}

    def run_in_worker(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        local_rank: int,
        local_world_size: int,
    ) -> Any:
        return xla.run_in_worker(function, args, kwargs, local_rank, local_world_size)


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
