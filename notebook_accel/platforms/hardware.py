"""A snapshot of what the machine has: the plain data every platform reads.

Nothing here looks at a device. Each platform fills in its own part without
initialising anything (platforms/cuda.py through NVML, platforms/xla.py from
PCI ids and environment variables), and `platforms.detect_hardware()` puts
the parts together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML describes it; `index` is the number torch gives it."""

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
    accelerator_type: str = ""  # "v2-8", "v5e-1", "v5litepod-8", ... when the host says
    platform: str = ""  # "colab", "kaggle", "tpu-vm" or "" (not a TPU)
    missing: str = ""  # what must be installed before it can run, if anything
    chip: str = ""  # the chip's generation from its PCI id: "v2/v3", "v4", "v5e", "v6e", ...
    # False when the chips are on the PCI bus but their device files are not here
    # (a container that was not given the TPU).
    reachable: bool = True

    @property
    def devices(self) -> int:
        """Every XLA device of this host (processes times devices per process)."""
        return self.processes * self.devices_per_process


@dataclass(frozen=True)
class AcceleratorDevices:
    """The devices of a `torch.accelerator` type other than CUDA (XPU, NPU, MPS, ...).

    `problem` says why they cannot be used (their package failed to import);
    the CPU stays usable then.
    """

    device_type: str
    count: int = 0
    name: str = ""
    memory_bytes: int = 0
    # The precisions autocast takes on them ("fp16", "bf16"), as their device module says.
    precisions: tuple[str, ...] = ()
    package: str = ""  # the package that registers the device with torch ("": torch)
    problem: str = ""


@dataclass(frozen=True)
class Hardware:
    """A snapshot of the devices a launch can use."""

    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    tpu_cores: int = 0
    xla: XlaInfo | None = None
    cpu_cores: int = 1
    ram_bytes: int = 0
    accelerators: AcceleratorDevices | None = None

    @property
    def accelerator(self) -> str:
        """The platform a launch picks by default: "cuda", "xla", another
        `torch.accelerator` device type ("xpu", "mps", ...) or "cpu"."""
        if self.gpus:
            return "cuda"
        if self.tpu_cores:
            return "xla"
        if self.usable_accelerators is not None:
            return self.usable_accelerators.device_type
        return "cpu"

    @property
    def device_choices(self) -> tuple[tuple[int, str], ...]:
        """(index, label) of each accelerator device a launch may pick by index."""
        if self.gpus:
            return tuple((gpu.index, f"GPU {gpu.index}") for gpu in self.gpus)
        found = self.usable_accelerators
        if found is None:
            return ()
        return tuple((index, f"{found.device_type}:{index}") for index in range(found.count))

    @property
    def usable_accelerators(self) -> AcceleratorDevices | None:
        """`accelerators` when there are some and nothing keeps them from use."""
        found = self.accelerators
        return found if found is not None and found.count and not found.problem else None


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset and container limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
