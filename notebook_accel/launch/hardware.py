"""What the machine has, read without initialising CUDA or XLA in this process.

Forked workers cannot use CUDA if the parent initialised the driver, nor a TPU
if the parent started the XLA runtime, so every read here goes through NVML
(the management library, which is fork-safe) or through files and environment
variables. TPU detection imports nothing: it reads PCI ids, device files and
the variables Colab, Kaggle and TPU VMs set.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
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
class XlaInfo:
    """This host's XLA devices as PJRT numbers them.

    PJRT runs one process per TPU chip; a chip of TPU v2 or v3 has two cores,
    which that process drives in two threads (one device each).
    """

    device_type: str  # "TPU", or "CPU" when PJRT_DEVICE=CPU
    processes: int
    devices_per_process: int = 1
    accelerator_type: str = ""  # "v2-8", "v5litepod-8", ... when the host says
    platform: str = ""  # "colab", "kaggle", "tpu-vm" or "" (not a TPU)
    missing: str = ""  # what must be installed before it can run, if anything

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process


@dataclass(frozen=True)
class Hardware:
    """A snapshot of the devices a launch can use."""

    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    tpu_cores: int = 0
    xla: XlaInfo | None = None
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
    if torch.cuda.is_initialized():  # nothing left to protect
        return torch.cuda.device_count()
    # torch.cuda.device_count() falls back to the CUDA runtime (which initialises
    # the driver, so forked workers could no longer use CUDA) when NVML cannot
    # count, as with MIG UUIDs in CUDA_VISIBLE_DEVICES. Count without it.
    count = torch.cuda._device_count_nvml()
    if count >= 0:
        return count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([name for name in visible.split(",") if name.strip()])
    return len(_nvml_gpus())


def detect() -> Hardware:
    """Read the machine's GPUs, TPU cores, CPU cores and memory."""
    count = cuda_device_count()
    details = {gpu.index: gpu for gpu in _nvml_gpus()} if count else {}
    visible = _visible_indices(count)
    gpus = tuple(
        GpuInfo(local, *_fields(details.get(physical))) for local, physical in enumerate(visible)
    )
    xla = detect_xla(os.environ)
    return Hardware(
        gpus=gpus,
        tpu_cores=xla.devices if xla and xla.device_type == "TPU" else 0,
        xla=xla,
        cpu_cores=cpu_cores(),
        ram_bytes=psutil.virtual_memory().total,
    )


# The public name: `notebook_accel.detect_hardware()`.
detect_hardware = detect


# -- TPUs ------------------------------------------------------------------------

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
