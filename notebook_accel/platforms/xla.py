"""TPU cores (and XLA's CPU device) through torch_xla: every line of XLA code.

Nothing here imports torch_xla in the launching process: a kernel that never
imported it cannot have started its runtime, and TPUs are counted from PCI
ids, device files and the variables Colab, Kaggle and TPU VMs set.

TPU launching: each forked worker becomes one PJRT process.

How torch_xla's own launcher works (torch_xla/_internal/pjrt.py, 2.9):
`xmp.spawn`/`torch_xla.launch` start one process per TPU chip through a
`concurrent.futures.ProcessPoolExecutor`; each process runs
`initialize_multiprocess(local_rank, local_world_size)` (PJRT_LOCAL_PROCESS_*,
and on TPU the topology: TPU_VISIBLE_CHIPS, TPU_PROCESS_BOUNDS,
TPU_PROCESS_PORT, TPU_PROCESS_ADDRESSES, CLOUD_TPU_TASK_ID) and then the
function in one thread per addressable device (`_run_thread_per_device`; two
on a TPU v2/v3 chip).

The process pool is the part a notebook cannot live with: it drops return
values of `xmp.spawn`, turns a worker's exception into a pickled copy without
its output, leaves no way to stop a run short of killing the kernel, and mixes
every worker's output on one stream. So the launcher keeps its own
`WorkerGroup` (fork, output pipes, message channel, teardown, the same on
every backend), and inside each forked worker calls torch_xla's own
per-process code above, with torch_xla's own initialiser. What each worker
does on the device is then exactly what it does under `xmp.spawn`.

Nothing here imports torch_xla in the launching process: a kernel that never
imported it cannot have started its runtime.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from notebook_accel import ops
from notebook_accel.data import DataLoaderShard
from notebook_accel.kwargs import InitProcessGroupKwargs
from notebook_accel.platforms.base import DistributedType, Platform
from notebook_accel.platforms.hardware import Hardware, XlaInfo

INSTALL_HINT = 'pip install "notebook-accel[xla]"'


def import_torch_xla() -> Any:
    """torch_xla, or an ImportError that says how to install it."""
    try:
        import torch_xla
    except ImportError as error:
        raise ImportError(
            f"The XLA backend (TPUs) needs torch_xla, which is not installed: {INSTALL_HINT} "
            '(on a TPU VM also libtpu: pip install "torch_xla[tpu]"). Colab and Kaggle '
            "TPU runtimes come with it."
        ) from error
    return torch_xla


def runtime_initialized_here() -> bool:
    """Whether this process already started the XLA runtime (used an XLA device).

    Only asked when torch_xla is imported already: a process that never
    imported it has no runtime. `_xla_runtime_is_initialized` is what
    torch_xla's own spawn checks before it forks; it starts nothing.
    """
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return False
    check = getattr(getattr(torch_xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    return bool(check()) if check is not None else False


class XlaPlatform(Platform):
    """TPU cores through torch_xla/PJRT, one worker process per chip.

    A worker becomes a PJRT process with torch_xla's own initialiser, so rank
    and world come from the XLA runtime and there is no torch.distributed
    group to join. Gradients are averaged at the optimizer step
    (`xm.reduce_gradients`), not by a DDP wrapper; batches and collectives
    cut the lazy graph (see XlaDataLoaderShard and XlaCollectives below).
    """

    name = "xla"
    process_group_backend = "xla"
    distributed_type = DistributedType.XLA
    device_noun = "TPU core"
    wraps_model_in_ddp = False
    # Importing these may start the XLA/PJRT runtime or claim the TPU.
    device_packages = ("jax", "jaxlib", "libtpu", "tensorflow", "torch_xla")
    # In the kernel itself the function would start the XLA runtime there, and
    # a started runtime cannot be stopped: every later launch would be refused
    # until a restart. So one worker is forked too.
    single_worker_in_process = False
    supports_multinode = False

    # -- the kernel's half -------------------------------------------------------

    def device_count(self, hardware: Hardware) -> int:
        return hardware.xla.devices if hardware.xla else 0

    def offered(self, hardware: Hardware) -> bool:
        return hardware.tpu_cores > 0  # XLA's CPU device is for tests, not the panel

    def processes_for(self, hardware: Hardware, devices: list[int], asked: int) -> int:
        return hardware.tpu_cores  # torch_xla runs every core of the host

    def check_available(self, hardware: Hardware) -> None:
        if hardware.xla is None:
            raise RuntimeError(f"backend='xla' cannot run here: {_why_no_xla(os.environ)}.")
        if importlib.util.find_spec("torch_xla") is None:
            raise ImportError(
                f"backend='xla' needs torch_xla, which is not installed: {INSTALL_HINT}."
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
        return super().precision_problem(precision, hardware)

    def fork_problem(self) -> str | None:
        if runtime_initialized_here():
            return (
                "the XLA runtime is already initialised in this process (a cell touched an "
                "XLA device: torch_xla.device(), xm.xla_device(), model.to('xla') or "
                "xr.world_size()), and forked workers cannot use the TPU after that"
            )
        return None

    def fresh_start_problem(self) -> str | None:
        if runtime_initialized_here() and os.environ.get("PJRT_DEVICE", "TPU") == "TPU":
            # One process at a time can hold a TPU (pytorch/xla#9303).
            return (
                "this process holds the TPU, which one process at a time can use, so workers "
                "in fresh interpreters could not open it either. Restart the kernel and run "
                "the cells in order, creating models and tensors on the XLA device only "
                "inside the training function"
            )
        return None

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        # Said outright, so torch_xla does not guess (and warn) in every worker.
        return {"PJRT_DEVICE": os.environ.get("PJRT_DEVICE") or "TPU"}

    # -- the worker's half -------------------------------------------------------

    def run_in_worker(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        local_rank: int,
        local_world_size: int,
    ) -> Any:
        """Run `function` as PJRT process `local_rank` of `local_world_size`.

        Returns the value of this process's first device (the only one, except
        on TPU v2/v3, where the process's second core runs the same function in
        a second thread).
        """
        import_torch_xla()
        from torch_xla._internal import pjrt

        # Set rather than left to torch_xla's setdefault: a kernel's environment
        # may carry stale values from an earlier run.
        os.environ["PJRT_LOCAL_PROCESS_RANK"] = str(local_rank)
        os.environ["PJRT_LOCAL_PROCESS_COUNT"] = str(local_world_size)
        if local_world_size == 1:
            # What xmp.spawn(nprocs=1) does: one chip, no multi-process topology.
            def initialize(rank: int, world: int) -> None:
                pjrt.initialize_singleprocess()
        else:
            initialize = pjrt.initialize_multiprocess

        def call() -> Any:
            # If the kernel ran a backward pass before the fork, autograd's engine
            # has sized its per-device queues without the XLA device, and the first
            # backward on XLA fails an internal assert (pytorch/xla#4174). Without
            # multithreading the engine runs XLA's backward (lazy tracing anyway) on
            # the calling thread and never looks those queues up.
            torch.autograd.set_multithreading_enabled(False)
            return function(*args, **kwargs)

        results = pjrt._run_thread_per_device(local_rank, local_world_size, call, initialize)
        return results[min(results)]

    def placement(self) -> tuple[int, int, int, int]:
        import_torch_xla()
        import torch_xla.runtime as xr

        return xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.local_device_count()

    def join(self, init_kwargs: InitProcessGroupKwargs) -> None:
        pass  # torch_xla's initialiser already set the replication up

    def collectives(self) -> ops.Collectives:
        return XlaCollectives()

    def device(self, local_rank: int) -> torch.device:
        return import_torch_xla().device()

    def barrier(self) -> None:
        # Cut the graph first: a value read after the barrier on one process alone
        # must not run work (collectives above all) the others have not run.
        import_torch_xla().sync()
        _xla_model().rendezvous("notebook_accel.barrier")

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        _xla_model().reduce_gradients(optimizer)

    def end_step(self) -> None:
        # A graph per training step, also for loops that do not read their batches
        # from a prepared DataLoader (which cuts it too); sync() does not wait.
        import_torch_xla().sync()

    def save(self, obj: object, path: str | os.PathLike) -> None:
        # xm.save moves tensors to the CPU first; master_only=False because the
        # caller is already the one process that writes.
        _xla_model().save(obj, path, master_only=False)

    def data_loader_class(self) -> type[DataLoaderShard]:
        return XlaDataLoaderShard

    def rng_states(self) -> dict[str, Any]:
        if "torch_xla" not in sys.modules:  # never imported here: nothing to save
            return {}
        return {"xla": _xla_model().get_rng_state()}

    def set_rng_states(self, states: dict[str, Any]) -> None:
        if "xla" in states and "torch_xla" in sys.modules:
            _xla_model().set_rng_state(states["xla"])

    def manual_seed(self, seed: int) -> None:
        if "torch_xla" in sys.modules:
            _xla_model().set_rng_state(seed)


def _xla_model() -> Any:
    import_torch_xla()
    import torch_xla.core.xla_model as xm

    return xm


def _why_no_xla(environ: Mapping[str, str]) -> str:
    if colab_tpu_node(environ):
        return (
            "this Colab runtime is a TPU Node (COLAB_TPU_ADDR), which PJRT cannot "
            "use; choose a TPU runtime of the TPU VM kind (Runtime > Change runtime "
            "type: v2-8, v5e-1 or v6e-1)"
        )
    return (
        "no TPU chips were found (PCI ids, /dev/accel*, /dev/vfio) and "
        "PJRT_DEVICE is not CPU; to try the XLA backend on this CPU, set "
        "PJRT_DEVICE=CPU before launching"
    )


class XlaCollectives(ops.Collectives):
    """The same collectives through torch_xla (TPU cores, or XLA's CPU device).

    XLA tensors are lazy: each collective ends with a graph cut, so that every
    process runs the same graph up to it, and a value read afterwards on one
    process alone (say, a metric on the main process) does not run a collective
    that the others would run in a different graph.
    """

    def __init__(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._torch_xla, self._xm, self._xr = torch_xla, xm, xr

    def world_size(self) -> int:
        return self._xr.world_size()

    def _on_device(self, op: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor):
        moved = tensor if tensor.device.type == "xla" else tensor.to(self._torch_xla.device())
        result = op(moved)
        self._torch_xla.sync()
        return result if result.device == tensor.device else result.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._on_device(lambda t: self._xm.all_gather(t, dim=0), tensor)

    def all_reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        kind = self._xm.REDUCE_MAX if reduction == "max" else self._xm.REDUCE_SUM
        return tensor.copy_(self._on_device(lambda t: self._xm.all_reduce(kind, t), tensor))

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        def broadcast_one(moved: torch.Tensor) -> torch.Tensor:
            self._xm.collective_broadcast([moved], root_ordinal=src)
            return moved

        return self._on_device(broadcast_one, tensor)

    def all_gather_object(self, obj: Any) -> list:
        return self._xm.mesh_reduce("notebook_accel.gather_object", obj, list)

    def broadcast_object_list(self, objects: list, src: int) -> None:
        chosen = self._xm.mesh_reduce(
            "notebook_accel.broadcast_object_list", list(objects), lambda every: every[src]
        )
        objects[:] = chosen


class XlaDataLoaderShard(DataLoaderShard):
    """A DataLoaderShard for XLA devices: each batch starts a new lazy graph.

    Before a batch goes to the device, the graph the previous step built is
    cut and sent off to run (`torch_xla.sync()`, which does not wait), as
    torch_xla's MpDeviceLoader does on each `next`; without the cut, graphs
    would grow step after step. The transfer itself happens here, in the
    training thread, not in MpDeviceLoader's background threads: there an
    exception raised by the dataset ends the thread, and the epoch, early and
    silently, and their shuffling would draw from the global generator
    concurrently with the training loop.
    """

    def _to_device(self, batch: Any) -> Any:
        if self.device is not None:
            import_torch_xla().sync()
        return super()._to_device(batch)


# -- counting TPU cores without starting the runtime -----------------------------

# PCI ids of TPU chips (vendor Google), as torch_xla/_internal/tpu.py lists
# them, with the TPU generation each one is.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_GENERATIONS = {
    "0x0027": 3,  # v2 and v3: two cores per chip
    "0x005e": 4,
    "0x0063": 5,  # v5e
    "0x0062": 5,  # v5p
    "0x006f": 6,  # v6e
    "0x0076": 7,
}


def detect_xla(
    environ: Mapping[str, str],
    root: str = "/",
    module_available: Callable[[str], bool] | None = None,
) -> XlaInfo | None:
    """The XLA devices PJRT would use here, or None; initialises nothing.

    `environ` and `root` (where /sys and /dev are looked up) are parameters so
    that other machines can be described in tests. `module_available(name)`
    says whether a module could be imported, without importing it.
    """
    available = module_available or _module_available
    device_type = environ.get("PJRT_DEVICE", "").upper().split("_")[0]
    if device_type == "CPU":
        count = _positive_int(environ.get("CPU_NUM_DEVICES")) or 1
        return XlaInfo("CPU", processes=1, devices_per_process=count)
    if device_type not in ("", "TPU"):
        return None  # XLA on GPUs or Neuron cores: not what this backend drives

    platform = _tpu_platform(environ)
    accelerator_type = environ.get("TPU_ACCELERATOR_TYPE") or environ.get("ACCELERATOR_TYPE", "")
    generations = _pci_tpu_generations(root)
    chips = len(generations)
    if not chips:
        chips = _count(root, "dev/accel[0-9]*")
    if not chips and (accelerator_type or platform in ("colab", "kaggle") or device_type):
        # TPU v5e and later appear as VFIO devices; other passthrough devices can
        # too, so these count only on a host that says it has TPUs.
        chips = _count(root, "dev/vfio/[0-9]*")
    if not chips:
        return None

    generation = _generation(accelerator_type) or (max(generations) if generations else 0)
    cores_per_chip = 2 if 0 < generation <= 3 else 1
    processes = chips
    bounds = environ.get("TPU_PROCESS_BOUNDS")
    if bounds:  # torch_xla starts no more processes than the bounds hold
        size = 1
        for part in bounds.split(","):
            size *= _positive_int(part) or 1
        processes = min(chips, size)
    missing = ""
    if not (
        available("libtpu")
        or environ.get("TPU_LIBRARY_PATH")
        or environ.get("PTXLA_TPU_LIBRARY_PATH")
    ):
        missing = 'libtpu (pip install "torch_xla[tpu]")'
    return XlaInfo(
        "TPU",
        processes=processes,
        devices_per_process=cores_per_chip,
        accelerator_type=accelerator_type,
        platform=platform or "tpu-vm",
        missing=missing,
    )


def _tpu_platform(environ: Mapping[str, str]) -> str:
    if any(name.startswith("COLAB_") for name in environ):
        return "colab"
    if any(name.startswith("KAGGLE_") for name in environ):
        return "kaggle"
    return ""


def colab_tpu_node(environ: Mapping[str, str]) -> bool:
    """A Colab runtime of the retired TPU Node kind (a remote TPU that PJRT cannot use)."""
    return bool(environ.get("COLAB_TPU_ADDR"))


def _pci_tpu_generations(root: str) -> list[int]:
    found = []
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            if _read(vendor) != _GOOGLE_PCI_VENDOR:
                continue
            device = _read(os.path.join(os.path.dirname(vendor), "device"))
        except OSError:
            continue
        if device in _TPU_PCI_GENERATIONS:
            found.append(_TPU_PCI_GENERATIONS[device])
    return found


def _generation(accelerator_type: str) -> int:
    match = re.match(r"^(?:v|tpu)(\d)", accelerator_type)
    return int(match.group(1)) if match else 0


def _read(path: str) -> str:
    with open(path) as file:
        return file.read().strip()


def _count(root: str, pattern: str) -> int:
    return len(glob.glob(os.path.join(root, pattern)))


def _positive_int(text: str | None) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        return 0
    return value if value > 0 else 0


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
