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

Outside a launch: an `Accelerator()` (or `PartialState()`) made in a kernel on a
TPU machine trains there, one process on the first core, as Accelerate's does.
It imports torch_xla and names the device `xla:0` without starting the runtime;
the runtime starts when a model or tensor first goes there, and from then on the
kernel holds the TPU, so a launch asks for a restart first.
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

from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.platforms.base import DistributedType, Platform
from notebook_accel.platforms.collectives import Collectives
from notebook_accel.platforms.hardware import Hardware, XlaInfo

# torch_xla's last release: 2.9, for torch 2.9 (pytorch/xla#9752 asks whether it
# is still maintained). Each release works with the torch of its own version only,
# and its wheel does not say so (no torch requirement), so pip installs a
# torch_xla that cannot load beside another torch.
LAST_TORCH_XLA = (2, 9)


def install_command(torch_version: str = torch.__version__) -> str:
    """The pip command that brings the torch_xla (with libtpu) matching `torch_version`."""
    release = _release(torch_version)
    if release <= LAST_TORCH_XLA:
        return f'pip install "torch_xla[tpu]=={release[0]}.{release[1]}.*"'
    last = ".".join(map(str, LAST_TORCH_XLA))
    return f'pip install "torch=={last}.*" "torch_xla[tpu]=={last}.*"'


def missing_torch_xla(platform: str = "") -> str:
    """Why torch_xla is needed and how to get it, for this kind of TPU host."""
    fix = f"{install_command()}, then restart the kernel"
    if _release(torch.__version__) > LAST_TORCH_XLA:
        version = torch.__version__.split("+")[0]
        fix += f" (torch_xla has no release for torch {version}; its last one needs torch 2.9)"
    fix += " (the xla extra, pip install 'notebook-accel[xla]', brings that pair)"
    if platform == "kaggle":
        # A notebook pinned to an older environment, or to the CPU/GPU image,
        # runs without torch_xla even on a TPU (Kaggle/kaggle-cli#1197).
        fix = (
            "in the notebook's settings choose 'Always use latest environment' instead of "
            f"a pinned one (the TPU image comes with torch_xla), or {fix}"
        )
    if importlib.util.find_spec("torch_tpu") is not None:
        fix += (
            ". torch_tpu, PyTorch's own TPU backend, is installed here; notebook_accel "
            "drives TPUs through torch_xla only (see the TPU section of "
            "docs/guides/launcher.md)"
        )
    return f"the XLA backend (TPUs) needs torch_xla, which is not installed: {fix}"


def import_torch_xla() -> Any:
    """torch_xla, or an ImportError that says how to install it."""
    try:
        import torch_xla
    except ImportError as error:
        message = missing_torch_xla(_tpu_platform(os.environ))
        raise ImportError(message[0].upper() + message[1:] + ".") from error
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
    cut the lazy graph (see before_batch_transfer and XlaCollectives below).
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
        info = hardware.xla
        if info is None:
            raise RuntimeError(f"backend='xla' cannot run here: {_why_no_xla(os.environ)}.")
        if not info.reachable:
            device_file = "/dev/accelN" if info.chip in _ACCEL_CHIPS else "/dev/vfio/N"
            raise RuntimeError(
                f"backend='xla' found {info.devices} TPU core(s) on this machine's PCI bus but "
                f"not their device files ({device_file}): this process was not given the TPU"
                f"{_how_to_get_the_tpu(info.platform)}. To train on CPU workers instead, "
                "pass backend='cpu'."
            )
        if importlib.util.find_spec("torch_xla") is None:
            # Not a CPU run instead: a TPU is here, only the package is missing.
            found = describe_tpu(info)
            raise ImportError(
                f"{found[0].upper()}{found[1:]}, but {missing_torch_xla(info.platform)}."
            )
        if info.missing:
            raise RuntimeError(
                f"backend='xla' found {info.devices} TPU core(s) but not {info.missing}."
            )

    def devices_summary(self, hardware: Hardware) -> str:
        info = hardware.xla
        if info is None or info.device_type != "TPU":
            return ""
        if info.devices == 1:
            return f"{describe_tpu(info)}, so a launch trains in one worker process"
        return describe_tpu(info)

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
                f"{info.devices} of this host (one process per chip; {describe_tpu(info)}). "
                f"Pass num_processes={info.devices} or 1."
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
                "XLA device: torch_xla.device(), xm.xla_device(), model.to('xla'), "
                "xr.world_size(), or accelerator.prepare(model) with an Accelerator made "
                "outside a launch), and forked workers cannot use the TPU after that"
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
        if not _in_pjrt_process():
            return 0, 1, 0, 1  # one process on the host's first core, as in Accelerate
        import_torch_xla()
        import torch_xla.runtime as xr

        return xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.local_device_count()

    def join(self, init_kwargs: InitProcessGroupKwargs) -> None:
        pass  # torch_xla's initialiser already set the replication up

    def collectives(self) -> Collectives:
        # Alone, a process has nothing to exchange: asking torch_xla for the world
        # would start the runtime.
        return XlaCollectives() if _in_pjrt_process() else Collectives()

    def device(self, local_rank: int) -> torch.device:
        torch_xla = import_torch_xla()  # registers the "xla" device with torch
        if not _in_pjrt_process():
            # Named, not asked for: torch_xla.device() would start the runtime now and
            # hold the TPU; it starts when the device is first used, as CUDA does.
            return torch.device("xla", 0)
        return torch_xla.device()

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

    def before_batch_transfer(self) -> None:
        # Each batch starts a new lazy graph: the graph the previous step built is
        # cut and sent off to run (torch_xla.sync(), which does not wait), as
        # torch_xla's MpDeviceLoader does on each `next`; without the cut, graphs
        # would grow step after step. The transfer itself happens in the training
        # thread, not in MpDeviceLoader's background threads: there an exception
        # raised by the dataset ends the thread, and the epoch, early and silently,
        # and their shuffling would draw from the global generator concurrently
        # with the training loop.
        import_torch_xla().sync()

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


def _in_pjrt_process() -> bool:
    """Whether this process is one of a launch's PJRT processes (ours or `xmp.spawn`'s).

    Both set PJRT_LOCAL_PROCESS_COUNT before the function runs. Elsewhere (an
    `Accelerator()` made in the kernel) the process trains alone.
    """
    return "PJRT_LOCAL_PROCESS_COUNT" in os.environ


def check_tpu_in_process(info: XlaInfo) -> None:
    """Raise, saying why and what to do, when this process cannot train on its TPU.

    Asked when `Accelerator()` or `PartialState()` is made outside a launch on a
    machine with a TPU: that process then trains on the TPU, never silently on the CPU.
    """
    where = describe_tpu(info)
    start = f"{where[0].upper()}{where[1:]}, but Accelerator() cannot train on it in this process"
    to_cpu = "To train on the CPU instead, pass cpu=True."
    if not info.reachable:
        device_file = "/dev/accelN" if info.chip in _ACCEL_CHIPS else "/dev/vfio/N"
        raise RuntimeError(
            f"{start}: its device files ({device_file}) are not here, so this process was "
            f"not given the TPU{_how_to_get_the_tpu(info.platform)}. {to_cpu}"
        )
    if not _module_available("torch_xla"):
        raise ImportError(f"{start}: {missing_torch_xla(info.platform)}. {to_cpu}")
    if info.missing:
        raise RuntimeError(f"{start}: {info.missing} is not installed. {to_cpu}")


def _why_no_xla(environ: Mapping[str, str]) -> str:
    if colab_tpu_node(environ):
        return (
            "this Colab runtime is a TPU Node (COLAB_TPU_ADDR), which PJRT cannot "
            "use; choose a TPU runtime of the TPU VM kind (Runtime > Change runtime "
            "type: v5e-1 or v6e-1)"
        )
    platform = _tpu_platform(environ)
    if platform:
        where = "this Colab runtime" if platform == "colab" else "this Kaggle session"
        return f"{where} has no TPU{_how_to_get_the_tpu(platform)}"
    return (
        "no TPU chips were found (PCI ids, /dev/accel*, /dev/vfio) and "
        "PJRT_DEVICE is not CPU; to try the XLA backend on this CPU, set "
        "PJRT_DEVICE=CPU before launching"
    )


def _how_to_get_the_tpu(platform: str) -> str:
    if platform == "colab":
        return ": choose Runtime > Change runtime type > TPU (v5e-1 or v6e-1)"
    if platform == "kaggle":
        # kaggle-cli#1197: a pinned CPU/GPU image overrides the TPU VM, which
        # then runs with neither the TPU's device files nor torch_xla.
        return (
            ": choose the TPU VM v5e-8 accelerator in the notebook's settings and "
            "'Always use latest environment' there; a notebook pinned to a CPU or GPU "
            "environment runs without the TPU even when a TPU is chosen"
        )
    return ""


class XlaCollectives(Collectives):
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


# -- counting TPU chips without starting the runtime -----------------------------

# TPU chips on the PCI bus (vendor Google) by device id, with their generation,
# as torch_xla (torch_xla/_internal/tpu.py), torch_tpu (_internal/utils/hardware.py)
# and Google's tpu-info (tpu_info/device.py) list them.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_CHIPS = {
    "0x0027": "v2/v3",  # two cores per chip
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x0062": "v5p",
    "0x006f": "v6e",
    "0x0076": "7x",
}
# A process opens a v2, v3 or v4 chip through /dev/accelN, a later one through
# its VFIO group, /dev/vfio/N (tpu-info's chip_path).
_ACCEL_CHIPS = ("v2/v3", "v4")


def detect_xla(
    environ: Mapping[str, str],
    root: str = "/",
    module_available: Callable[[str], bool] | None = None,
) -> XlaInfo | None:
    """The XLA devices PJRT would use here, or None; initialises nothing.

    `environ` and `root` (where /sys and /dev are looked up) are parameters so
    that other machines can be described in tests. `module_available(name)`
    says whether a module could be imported, without importing it.

    What the TPU runtimes set, for reference: Colab's v5e-1 and v6e-1 set
    TPU_ACCELERATOR_TYPE (v5e-1, v6e-1), COLAB_TPU_1VM=1, TPU_SKIP_MDS_QUERY=1
    and TPU_HOST_BOUNDS; Kaggle's v5e-8 image sets ISTPUVM=1 and
    TPU_PROCESS_ADDRESSES=local (Kaggle/docker-python, tpu/Dockerfile), and the
    session TPU_ACCELERATOR_TYPE=v5litepod-8 ("v5litepod" is the Cloud TPU API's
    name for v5e); a TPU VM keeps them in its metadata server, which this never
    asks. The chips are counted from the PCI bus and the device files, so a
    variable only names the kind.
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
    on_bus = _pci_tpu_chips(root)
    chips = [chip for chip, folder in on_bus if _openable(root, chip, folder)]
    unopened = len(on_bus) - len(chips)
    count = len(chips)
    if not on_bus:
        count = _count(root, "dev/accel[0-9]*")
        says_tpu = accelerator_type or platform or device_type or environ.get("ISTPUVM")
        if not count and says_tpu:
            # Other passthrough devices are VFIO groups too, so these count only
            # on a host that says it has TPUs.
            count = _count(root, "dev/vfio/[0-9]*")
    if not count and not unopened:
        return None

    chip = chips[0] if chips else (on_bus[0][0] if on_bus else "")
    generation = _generation(accelerator_type) or _generation(chip)
    cores_per_chip = 2 if 0 < generation <= 3 else 1
    processes = count or unopened
    bounds = environ.get("TPU_PROCESS_BOUNDS")
    if bounds:  # torch_xla starts no more processes than the bounds hold
        size = 1
        for part in bounds.split(","):
            size *= _positive_int(part) or 1
        processes = min(processes, size)
    missing = ""
    if not (
        available("libtpu")
        or environ.get("TPU_LIBRARY_PATH")
        or environ.get("PTXLA_TPU_LIBRARY_PATH")
    ):
        missing = f"libtpu ({install_command()})"
    return XlaInfo(
        "TPU",
        processes=processes,
        devices_per_process=cores_per_chip,
        accelerator_type=accelerator_type,
        platform=platform or "tpu-vm",
        missing=missing,
        chip=chip,
        reachable=bool(count),
    )


def describe_tpu(info: XlaInfo) -> str:
    """What this TPU host is, in words: "this Colab runtime is a TPU v5e-1 (1 chip, 1 core)"."""
    where = {
        "colab": "this Colab runtime",
        "kaggle": "this Kaggle session",
        "tpu-vm": "this TPU VM",
    }.get(info.platform, "this machine")
    chips = f"{info.processes} chip" + ("s" if info.processes != 1 else "")
    cores = f"{info.devices_per_process} core" + ("s" if info.devices_per_process != 1 else "")
    shape = f"{chips}, {cores}" + (" each" if info.processes != 1 else "")
    kind = info.accelerator_type.replace("v5litepod", "v5e")
    if kind:
        return f"{where} is a TPU {kind} ({shape})"
    if info.chip:
        return f"{where} has TPU {info.chip} chips ({shape})"
    return f"{where} has TPUs ({shape})"


def _tpu_platform(environ: Mapping[str, str]) -> str:
    if any(name.startswith("COLAB_") for name in environ):
        return "colab"
    if any(name.startswith("KAGGLE_") for name in environ):
        return "kaggle"
    return ""


def colab_tpu_node(environ: Mapping[str, str]) -> bool:
    """A Colab runtime of the retired TPU Node kind (a remote TPU that PJRT cannot use)."""
    return bool(environ.get("COLAB_TPU_ADDR"))


def _pci_tpu_chips(root: str) -> list[tuple[str, str]]:
    """(chip generation, sysfs folder) of every TPU chip on the PCI bus."""
    found = []
    for vendor in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor"))):
        folder = os.path.dirname(vendor)
        try:
            if _read(vendor) != _GOOGLE_PCI_VENDOR:
                continue
            chip = _TPU_PCI_CHIPS.get(_read(os.path.join(folder, "device")))
        except OSError:
            continue
        if chip:
            found.append((chip, folder))
    return found


def _openable(root: str, chip: str, folder: str) -> bool:
    """Whether this process has the device file it would open the chip through.

    /sys lists every chip of the host, also in a container that was given
    some or none of them; only the chips it was given have their device file.
    A VFIO chip is the one whose IOMMU group is under /dev/vfio (torch_tpu
    counts chips so, in _internal/utils/hardware.py).
    """
    if chip in _ACCEL_CHIPS:
        return bool(_count(root, "dev/accel[0-9]*"))
    try:
        group = os.path.basename(os.readlink(os.path.join(folder, "iommu_group")))
    except OSError:  # no IOMMU group recorded: any VFIO group will do
        return bool(_count(root, "dev/vfio/[0-9]*"))
    return os.path.exists(os.path.join(root, "dev/vfio", group))


def _generation(name: str) -> int:
    """3 for "v3-8" or "v2/v3", 5 for "v5e-1" or "v5litepod-8", 7 for "7x" or "tpu7x"."""
    match = re.match(r"^(?:v|tpu)?(\d)", name)
    return int(match.group(1)) if match else 0


def _release(version: str) -> tuple[int, int]:
    """(2, 8) for "2.8.0+cpu"."""
    major, minor, *_ = [_positive_int(part) for part in version.split("+")[0].split(".")] + [0, 0]
    return major, minor


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
