"""Who this process is: rank, world size, device, and the process group.

One small class per backend (CPU/gloo, CUDA/nccl, XLA) holds everything that
differs between devices; it is chosen once, when the state is built, so no
other module asks "which backend is this?".
"""

from __future__ import annotations

import atexit
import enum
import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from notebook_accel import ops
from notebook_accel.config import (
    ENV_RENDEZVOUS_TIMEOUT,
    RENDEZVOUS_TIMEOUT_SECONDS,
    LaunchSettings,
)
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
    # Gradients are all-reduced by DistributedDataParallel during backward.
    wraps_model_in_ddp = True

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
            _init_process_group(self, init_kwargs)

    def collectives(self) -> ops.Collectives:
        return ops.Collectives()

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

    def barrier(self) -> None:
        dist.barrier()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average the gradients of `optimizer` over the processes, where the model
        wrapper has not done it already (DDP has)."""

    def end_step(self) -> None:
        """Called after each optimizer step that updated the weights."""

    def save(self, obj: object, path: str | os.PathLike) -> None:
        """Write `obj` (tensors on this backend's device included) so `torch.load` reads
        it on the CPU. Called by the process that writes, after `barrier()`."""
        torch.save(obj, path)

    def data_loader_class(self) -> type:
        """The DataLoaderShard class that feeds this backend's device."""
        from notebook_accel.data import DataLoaderShard

        return DataLoaderShard


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

    def barrier(self) -> None:
        # Without device_ids nccl guesses the device and warns about it.
        dist.barrier(device_ids=[torch.cuda.current_device()])


class XlaBackend(Backend):
    """TPU cores (or XLA's CPU device) through torch_xla, imported only here.

    The launcher has made this process a PJRT process with torch_xla's own
    initialiser, so rank and world come from the XLA runtime and there is no
    torch.distributed group to join. Gradients are averaged at the optimizer
    step (`xm.reduce_gradients`), not by a DDP wrapper; batches and
    collectives cut the lazy graph (see data.XlaDataLoaderShard, ops.XlaCollectives).
    """

    name = "xla"
    process_group_backend = "xla"
    distributed_type = DistributedType.XLA
    wraps_model_in_ddp = False

    def __init__(self) -> None:
        from notebook_accel.launch.xla import import_torch_xla

        self.torch_xla = import_torch_xla()
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self.xm, self.xr = xm, xr

    def placement(self) -> tuple[int, int, int, int]:
        xr = self.xr
        return xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.local_device_count()

    def join(self, init_kwargs: InitProcessGroupKwargs) -> None:
        pass  # torch_xla's initialiser already set the replication up

    def collectives(self) -> ops.Collectives:
        return ops.XlaCollectives()

    def device(self, local_rank: int) -> torch.device:
        return self.torch_xla.device()

    def precision_problem(self, precision: str) -> str | None:
        if precision == "fp16":
            return (
                "mixed_precision='fp16' is not available on XLA devices: TPUs compute in "
                "bfloat16. Use mixed_precision='bf16' instead."
            )
        if precision == "fp8":
            return (
                "mixed_precision='fp8' needs a CUDA GPU of compute capability 8.9 or newer "
                "and the torchao package. Use mixed_precision='bf16' instead."
            )
        return None

    def barrier(self) -> None:
        # Cut the graph first: a value read after the barrier on one process alone
        # must not run work (collectives above all) the others have not run.
        self.torch_xla.sync()
        self.xm.rendezvous("notebook_accel.barrier")

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.xm.reduce_gradients(optimizer)

    def end_step(self) -> None:
        # A graph per training step, also for loops that do not read their batches
        # from a prepared DataLoader (which cuts it too); sync() does not wait.
        self.torch_xla.sync()

    def save(self, obj: object, path: str | os.PathLike) -> None:
        # xm.save moves tensors to the CPU first; master_only=False because the
        # caller is already the one process that writes.
        self.xm.save(obj, path, master_only=False)

    def data_loader_class(self) -> type:
        from notebook_accel.data import XlaDataLoaderShard

        return XlaDataLoaderShard


BACKENDS: dict[str, type[Backend]] = {"cpu": Backend, "cuda": CudaBackend, "xla": XlaBackend}


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
        backend = BACKENDS[_backend_name(cpu, launch)]()
        rank, world, local_rank, local_world = backend.placement()
        device = backend.device(local_rank)
        if world > 1:
            backend.join(init_kwargs or InitProcessGroupKwargs())
        ops.use_collectives(backend.collectives())
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
    timeout = None
    if kwargs.timeout is not None:
        timeout = (
            kwargs.timeout
            if isinstance(kwargs.timeout, timedelta)
            else timedelta(seconds=kwargs.timeout)
        )
    process_group_backend = kwargs.backend or backend.process_group_backend
    if kwargs.init_method not in (None, "env://"):
        dist.init_process_group(
            process_group_backend,
            init_method=kwargs.init_method,
            **({"timeout": timeout} if timeout else {}),
        )
        return
    # Meeting the others gets a short timeout of its own: a process that never
    # joins must not leave the rest waiting for the 30-minute collective timeout.
    waited = float(os.environ.get(ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_SECONDS))
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=waited)))
        # gloo and nccl wait for missing peers with the collective timeout (30
        # minutes), so first wait here, at the store, with the short one.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"notebook_accel/joined/{attempt}/"
        store.set(f"{key}{rank}", "1")
        store.wait([f"{key}{peer}" for peer in range(world)], timedelta(seconds=waited))
        # From here on the store serves the group (nccl reads its communicator id
        # from it at the first collective): give it the group's own timeout.
        store.set_timeout(timeout or dist.default_pg_timeout)
        dist.init_process_group(
            process_group_backend,
            store=store,
            rank=rank,
            world_size=world,
            **({"timeout": timeout} if timeout else {}),
        )
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        raise _rendezvous_error(waited, error) from error
    # Workers started by notebook_launcher leave with os._exit and skip this;
    # under torchrun the interpreter exits normally, and a process group still
    # alive then can abort the process ("terminate called without an active
    # exception") from its threads' destructors.
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            # A barrier first: destroy right after the last collective can hang a rank.
            dist.monitored_barrier(timeout=timedelta(seconds=30))
    except RuntimeError:
        pass  # a peer is gone; leave anyway
    finally:
        dist.destroy_process_group()


def _rendezvous_error(waited: float, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"rank {os.environ.get('RANK', '?')} waited {waited:.0f} s for all "
        f"{os.environ.get('WORLD_SIZE', '?')} processes to join and gave up ({error}). "
        "Every process must create its Accelerator (or join the process group); on "
        "several machines, check that every machine was started with the same "
        "master address and port."
    )
