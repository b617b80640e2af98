"""Who this process is: rank, world size, device, and the process group.

One small class per backend (CPU/gloo, CUDA/nccl) holds everything that
differs between devices; it is chosen once, when the state is built, so no
other module asks "which backend is this?". An XLA backend slots in the same
way.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from notebook_accel.config import LaunchSettings
from notebook_accel.kwargs import InitProcessGroupKwargs


class DistributedType(str, enum.Enum):
    """How the processes cooperate (Accelerate's names; compares equal to the strings)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"

    def __str__(self) -> str:
        return self.value


class Backend:
    """What differs between kinds of device. Subclasses override the class attributes."""

    name = "cpu"
    process_group_backend = "gloo"
    distributed_type = DistributedType.MULTI_CPU

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def precision_problem(self, precision: str) -> str | None:
        """Why this device cannot train in `precision`, or None when it can."""
        if precision == "fp8":
            return (
                "mixed_precision='fp8' needs a CUDA GPU of compute capability 8.9 or newer "
                "(H100, L4, RTX 40xx) and the torchao package; this process runs on the CPU. "
                "Use mixed_precision='bf16' instead."
            )
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings)."""

    def barrier(self) -> None:
        dist.barrier()


class CudaBackend(Backend):
    name = "cuda"
    process_group_backend = "nccl"
    distributed_type = DistributedType.MULTI_GPU

    def device(self, local_rank: int) -> torch.device:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"This process has LOCAL_RANK={local_rank} but sees only "
                f"{torch.cuda.device_count()} CUDA device(s). Start at most one process per GPU, "
                "or pass cpu=True to train on the CPU."
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def precision_problem(self, precision: str) -> str | None:
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return (
                f"{torch.cuda.get_device_name()} cannot compute in bfloat16; "
                "use mixed_precision='fp16' instead."
            )
        if precision == "fp8":
            missing = []
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                missing.append(
                    f"a GPU of compute capability 8.9 or newer (this "
                    f"{torch.cuda.get_device_name()} is {major}.{minor})"
                )
            if importlib.util.find_spec("torchao") is None:
                missing.append("the torchao package (pip install torchao)")
            if missing:
                return (
                    "mixed_precision='fp8' needs "
                    + " and ".join(missing)
                    + ". Use mixed_precision='bf16' instead."
                )
        return None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def barrier(self) -> None:
        # Without device_ids nccl guesses the device and warns about it.
        dist.barrier(device_ids=[torch.cuda.current_device()])


BACKENDS: dict[str, type[Backend]] = {"cpu": Backend, "cuda": CudaBackend}


@dataclass(frozen=True)
class ProcessState:
    """This process's place in the run. Built by `ProcessState.create()`."""

    backend: Backend
    process_index: int
    num_processes: int
    local_process_index: int
    local_num_processes: int
    device: torch.device

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> DistributedType:
        return self.backend.distributed_type if self.use_distributed else DistributedType.NO

    @classmethod
    def create(
        cls,
        cpu: bool = False,
        launch: LaunchSettings | None = None,
        init_kwargs: InitProcessGroupKwargs | None = None,
    ) -> ProcessState:
        """Read rank and world size from the environment and join the process group.

        Works inside a launched worker, under `torchrun`, and as a plain single
        process (no environment variables: rank 0 of 1). The process group is
        initialised here when the world is larger than one and nobody did it yet.
        """
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))

        backend = BACKENDS[_backend_name(cpu, launch)]()
        device = backend.device(local_rank)
        if world > 1 and not dist.is_initialized():
            _init_process_group(backend, init_kwargs or InitProcessGroupKwargs())
        return cls(backend, rank, world, local_rank, local_world, device)


def _backend_name(cpu: bool, launch: LaunchSettings | None) -> str:
    if cpu:
        return "cpu"
    if launch is not None:
        if launch.backend not in BACKENDS:
            raise NotImplementedError(
                f"The Accelerator has no {launch.backend!r} backend yet; "
                f"available: {', '.join(BACKENDS)}."
            )
        return launch.backend
    if dist.is_available() and dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _init_process_group(backend: Backend, kwargs: InitProcessGroupKwargs) -> None:
    if not dist.is_available():
        raise RuntimeError(
            "This torch build has no torch.distributed; it cannot run several processes."
        )
    if "MASTER_ADDR" not in os.environ and kwargs.init_method is None:
        raise RuntimeError(
            "WORLD_SIZE > 1 but MASTER_ADDR is not set, so this process cannot find the others. "
            "Start the processes with notebook_launcher(...) or torchrun."
        )
    options: dict = {
        "backend": kwargs.backend or backend.process_group_backend,
        "init_method": kwargs.init_method or "env://",
    }
    if kwargs.timeout is not None:
        options["timeout"] = (
            kwargs.timeout
            if isinstance(kwargs.timeout, timedelta)
            else timedelta(seconds=kwargs.timeout)
        )
    dist.init_process_group(**options)
