"""What every platform answers: the kernel's half and the worker's half.

A platform is one kind of device (CPU cores, CUDA GPUs, TPU cores through
XLA). The launching process asks it how many workers the machine takes,
which precisions it can run, whether it is still safe to fork, and what
each worker's environment holds, all from a `Hardware` snapshot and without
touching the device. A worker asks the same class where it runs, how it joins
the others, which collectives and loader to use, and how to save. The
launch plan carries only the platform's name; the worker looks the class up
in the registry (platforms/__init__.py).
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.platforms.collectives import Collectives
from notebook_accel.platforms.hardware import Hardware, cpu_cores
from notebook_accel.platforms.joining import join_process_group


class DistributedType(str, enum.Enum):
    """How the processes cooperate (Accelerate's names; compares equal to the strings)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    XLA = "XLA"
    # Never reported here; defined so that code comparing against them runs.
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    def __str__(self) -> str:
        return self.value


class LaunchRefused(RuntimeError):
    """The kernel is in a state that forked workers cannot run from."""


class Platform:
    """One kind of device. Subclasses set the class attributes and override what differs."""

    name: str = ""
    process_group_backend: str = ""
    distributed_type: DistributedType = DistributedType.MULTI_CPU
    device_noun: str = "device"
    # num_processes=1 runs the function in the launching process itself.
    single_worker_in_process: bool = True
    supports_multinode: bool = True
    # Gradients are all-reduced by DistributedDataParallel during backward.
    wraps_model_in_ddp: bool = True
    # The person picks devices by index (GPUs), rather than a number of workers.
    chooses_devices: bool = False
    # The person may choose any number of workers (CPU processes share the cores).
    free_process_count: bool = False
    # Host memory for copies to this device can be pinned (page-locked).
    pins_host_memory: bool = False
    # Packages (or dotted prefixes) whose import may start this device's runtime:
    # the launching process never imports them to warm the next launch.
    device_packages: tuple[str, ...] = ()

    # -- the kernel's half: asked before anything starts -------------------------

    def device_count(self, hardware: Hardware) -> int:
        """Devices of this kind on the machine, counted without initialising them."""
        raise NotImplementedError

    def offered(self, hardware: Hardware) -> bool:
        """Whether the panel and the default choice should offer this platform here."""
        return self.device_count(hardware) > 0

    def loaded_device_packages(self) -> list[str]:
        """Which of `device_packages` this process has imported (suspects, when the
        device's runtime started without torch saying where)."""
        return [name for name in self.device_packages if name in sys.modules]

    def check_available(self, hardware: Hardware) -> None:
        """Raise if this platform cannot run on this machine at all."""

    def devices_summary(self, hardware: Hardware) -> str:
        """What the machine has of this platform's devices, in words, for the message
        that refuses more workers than devices ("" when the count says it all)."""
        return ""

    def default_num_processes(self, hardware: Hardware) -> int:
        """Workers a launch starts when the caller does not say."""
        return self.device_count(hardware)

    def processes_for(self, hardware: Hardware, devices: list[int], asked: int) -> int:
        """Workers the panel's choices start: by default, as many as asked."""
        return asked

    def worker_processes(self, num_processes: int, hardware: Hardware) -> int:
        """How many worker processes run `num_processes` devices (raise if none can)."""
        return num_processes

    def oversubscription_allowed(self) -> bool:
        """Whether more workers than devices is a warning rather than an error."""
        return False

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        """Why `precision` cannot run on `hardware`, or None when it can.

        The one answer the launcher, the panel, the command line and
        `Accelerator()` all give (see `check_precision`).
        """
        if precision == "fp8":
            return (
                "fp8 needs a CUDA GPU of compute capability 8.9 or newer (H100, L4, RTX 40xx) "
                "and the torchao package; use mixed_precision='bf16'"
            )
        return None

    def check_precision(self, precision: str, hardware: Hardware) -> None:
        """Raise ValueError when `precision` cannot run on `hardware`."""
        problem = self.precision_problem(precision, hardware)
        if problem:
            raise ValueError(f"mixed_precision={precision!r} cannot run here: {problem}.")

    def fork_problem(self) -> str | None:
        """Why workers forked from this process now could not use the device, or None.

        Then the launcher forks them from a clean process (launch/template.py).
        """
        return None

    def fresh_start_problem(self) -> str | None:
        """Why even workers in fresh interpreters could not use the device, or None."""
        return None

    def check_parent_is_clean(self) -> None:
        """Raise LaunchRefused if this process can no longer fork working workers."""
        problem = self.fork_problem()
        if problem:
            raise LaunchRefused(problem)

    def guard_runtime_start(self, refuse: Callable[[], bool]) -> Callable[[], None]:
        """While `refuse()` is true, make starting this device's runtime raise
        RuntimeError instead (launch/warm.py imports with it on). Returns the undo."""
        return lambda: None

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        """Extra environment variables for one worker."""
        return {}

    # -- the worker's half: asked inside a worker (or a single process) ------------

    def process_hardware(self) -> Hardware:
        """What this process can see, for the precision check in `Accelerator()`."""
        return Hardware(cpu_cores=cpu_cores())

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

    def placement(self) -> tuple[int, int, int, int]:
        """(rank, world size, local rank, local world size) of this process."""
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        return rank, world, local_rank, local_world

    def join(self, init_kwargs: InitProcessGroupKwargs) -> None:
        """Join the other processes (called when the world is larger than one)."""
        if not dist.is_initialized():
            join_process_group(self.process_group_backend, init_kwargs)

    def collectives(self) -> Collectives:
        """The primitive collectives `notebook_accel.training.ops` runs on."""
        return Collectives()

    def device(self, local_rank: int) -> torch.device:
        """The device this process trains on."""
        return torch.device("cpu")

    def compile_problem(self, backend: str) -> str | None:
        """Why torch.compile's `backend` cannot compile for this device, or None."""
        return None

    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """DistributedDataParallel arguments this device needs."""
        return {}

    def barrier(self) -> None:
        """Wait until every process gets here."""
        dist.barrier()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the gradients of `optimizer` over the processes, where the model
        wrapper has not done it already (DDP has)."""

    def end_step(self) -> None:
        """Called after each optimizer step that updated the weights."""

    def save(self, obj: object, path: str | os.PathLike) -> None:
        """Write `obj` (tensors on this device included) so `torch.load` reads it on
        the CPU. Called by the process that writes, after `barrier()`."""
        torch.save(obj, path)

    def before_batch_transfer(self) -> None:
        """Called by a prepared loader before each batch goes to this device."""

    def copy_stream(self, device: torch.device) -> Any:
        """A side stream on which prepared loaders copy the next batch while the
        current one trains, or None where copies need none (see data.copy_plan)."""
        return None

    def rng_states(self) -> dict[str, Any]:
        """This device's random generator states, where the device is in use."""
        return {}

    def set_rng_states(self, states: dict[str, Any]) -> None:
        """Put back what `rng_states()` returned."""

    def peak_device_bytes(self) -> int | None:
        """The most device memory this process held, where the device reports it."""
        return None

    def empty_cache(self) -> None:
        """Give cached device memory back (after `Accelerator.free_memory`)."""

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generators (torch.manual_seed covers CPU and CUDA)."""
