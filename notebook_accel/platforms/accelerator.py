"""Every device type torch reports through `torch.accelerator`: one platform.

XPU, NPU, MLU, HPU, MUSA, SDAA, an out-of-tree PrivateUse1 device, and (as
`CudaPlatform`, a subclass) CUDA and ROCm GPUs all run through the code here:
one worker per device, rank r on device r (or on the r-th device the person
chose), the process-group backend torch maps the device type to, autocast
with that device type, memory and random generators through torch's
device-generic APIs. What differs between them is data (platforms/families.py);
what only one of them has stays in its subclass (cuda.py, mps.py).

The kernel's half reads a `Hardware` snapshot and never starts the device's
runtime; the worker's half runs where the device is in use.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.platforms.base import Platform
from notebook_accel.platforms.collectives import Collectives
from notebook_accel.platforms.families import FAMILIES, DeviceFamily, family_of
from notebook_accel.platforms.hardware import AcceleratorDevices, Hardware, cpu_cores

# The device indices a worker's local ranks map to, where the person chose some
# ("2,3": local rank 0 trains on device 2); unset: local rank r on device r.
ENV_DEVICE_INDICES = "NOTEBOOK_ACCEL_DEVICE_INDICES"
# The package that registers the device with torch, imported by a worker that
# starts in a fresh interpreter before it asks torch about the device.
ENV_DEVICE_PACKAGE = "NOTEBOOK_ACCEL_DEVICE_PACKAGE"

_PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class AcceleratorPlatform(Platform):
    """One process per device of a `torch.accelerator` device type."""

    chooses_devices = True

    def __init__(self, device_type: str, package: str = "") -> None:
        self.family: DeviceFamily = family_of(device_type)
        self.name = device_type
        self.distributed_type = self.family.distributed_type
        self.device_noun = self.family.title if device_type in FAMILIES else f"{device_type} device"
        self.package = self.family.package or package
        self.device_packages = (self.package,) if self.package else ()

    @property
    def title(self) -> str:
        return self.family.title

    @property
    def process_group_backend(self) -> str:  # type: ignore[override]
        # Asked when needed: a device's package registers its backend when imported.
        return self.family.backend or dist.Backend.default_device_backend_map.get(self.name, "")

    # -- the kernel's half -------------------------------------------------------

    def _devices(self, hardware: Hardware) -> AcceleratorDevices | None:
        found = hardware.accelerators
        return found if found is not None and found.device_type == self.name else None

    def device_count(self, hardware: Hardware) -> int:
        found = self._devices(hardware)
        return found.count if found is not None and not found.problem else 0

    def check_available(self, hardware: Hardware) -> None:
        found = self._devices(hardware)
        if found is not None and found.problem:
            raise RuntimeError(
                f"backend={self.name!r} cannot run: {found.problem}. The CPU stays usable: "
                "pass backend='cpu'."
            )
        if self.device_count(hardware) == 0:
            where = f" ({self.family.where})" if self.family.where else ""
            raise ValueError(
                f"backend={self.name!r} needs {self.title} devices, and this machine has "
                f"none{where}; it offers {offered_here(hardware)}."
            )

    def devices_summary(self, hardware: Hardware) -> str:
        found = self._devices(hardware)
        return found.name if found is not None else ""

    def processes_for(self, hardware: Hardware, devices: list[int], asked: int) -> int:
        return len(devices)  # one worker per chosen device

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        if precision == "fp8":
            return (
                f"fp8 training needs a CUDA GPU of compute capability 8.9 or newer; on "
                f"{self.title} devices use mixed_precision='bf16'"
            )
        if precision not in _PRECISION_DTYPES:
            return None
        found = self._devices(hardware)
        takes = found.precisions if found is not None and found.precisions else None
        if takes is None:
            takes = self.family.precisions
        if precision in takes:
            return None
        other = [name for name in takes if name != precision]
        instead = f"use mixed_precision={other[0]!r}" if other else "use mixed_precision='no'"
        return (
            f"{self.title} autocast does not take {precision} "
            f"(torch's {self.name} autocast takes {', '.join(takes) or 'no lower precision'}); "
            + instead
        )

    def fork_problem(self) -> str | None:
        if self.runtime_initialised():
            return (
                f"{self.title} is already initialised in this process, and a forked worker "
                f"cannot use a {self.title} device once its parent has"
            )
        return None

    def runtime_initialised(self) -> bool:
        """Whether this process has started the device's runtime (never starts it)."""
        module = device_module_of(self.name)
        is_initialized = getattr(module, "is_initialized", None)
        return bool(is_initialized is not None and is_initialized())

    def worker_environment(self, local_rank: int, devices: list[int] | None) -> dict[str, str]:
        env = {ENV_DEVICE_PACKAGE: self.package} if self.package else {}
        if devices is not None:
            env[ENV_DEVICE_INDICES] = ",".join(str(index) for index in devices)
        return env

    # -- the worker's half -------------------------------------------------------

    def device_module(self) -> Any:
        """torch's module for this device type (torch.xpu, torch.npu, ...)."""
        module = device_module_of(self.name)
        if module is None:
            raise RuntimeError(
                f"torch has no {self.name!r} device in this process"
                + (f": import {self.package} first" if self.package else "")
                + "."
            )
        return module

    def process_hardware(self) -> Hardware:
        index = self.current_index()
        found = AcceleratorDevices(
            self.name,
            count=1,
            name=_device_name(self.device_module(), index),
            precisions=amp_precisions(self.name),
        )
        return Hardware(accelerators=found, cpu_cores=cpu_cores())

    def device(self, local_rank: int) -> torch.device:
        count = self.device_module().device_count()
        indices = _chosen_indices()
        index = indices[local_rank] if indices and local_rank < len(indices) else local_rank
        if index >= count:
            raise RuntimeError(
                f"This process has LOCAL_RANK={local_rank} but sees only {count} "
                f"{self.device_noun}(s). Start at most one process per {self.device_noun}, or "
                "pass cpu=True to train on the CPU."
            )
        self.device_module().set_device(index)
        return torch.device(self.name, index)

    def current_index(self) -> int:
        """The index of this process's current device of this type (asked of the device's
        own module: on a CUDA build torch.accelerator would answer for CUDA)."""
        return int(self.device_module().current_device())

    def join(self, init_kwargs: InitProcessGroupKwargs) -> None:
        if not self.process_group_backend:
            raise RuntimeError(
                f"torch.distributed has no process-group backend for {self.title} devices "
                f"(torch.distributed.Backend.default_device_backend_map has no {self.name!r}); "
                "import the package that registers one, or pass cpu=True."
            )
        super().join(init_kwargs)

    def collectives(self) -> Collectives:
        # Device backends (nccl, xccl, hccl, ...) move only device tensors: CPU ones
        # (a generator state, a number made into a tensor) go through this process's device.
        return Collectives(staging=self._staging_device)

    def _staging_device(self) -> torch.device | None:
        if dist.get_backend() != self.process_group_backend:
            return None  # a gloo group (InitProcessGroupKwargs) moves CPU tensors
        return torch.device(self.name, self.current_index())

    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        return {"device_ids": [device.index], "output_device": device.index}

    def barrier(self) -> None:
        if dist.get_backend() == self.process_group_backend:
            # Without device_ids a device backend guesses the device (and nccl warns).
            dist.barrier(device_ids=[self.current_index()])
        else:
            dist.barrier()

    def copy_stream(self, device: torch.device) -> Any:
        return torch.Stream(device)

    def peak_device_bytes(self) -> int | None:
        if not self.runtime_initialised():
            return None
        return int(self.device_module().max_memory_allocated(self.current_index()))

    def empty_cache(self) -> None:
        if self.runtime_initialised():
            self.device_module().empty_cache()

    def manual_seed(self, seed: int) -> None:
        module = device_module_of(self.name)
        if module is not None and hasattr(module, "manual_seed_all"):
            module.manual_seed_all(seed)

    def rng_states(self) -> dict[str, Any]:
        # Only read where the runtime is already running: reading them could start it.
        if not self.runtime_initialised():
            return {}
        return {self.name: self.device_module().get_rng_state_all()}

    def set_rng_states(self, states: dict[str, Any]) -> None:
        if self.name in states and device_module_of(self.name) is not None:
            self.device_module().set_rng_state_all(states[self.name])


def device_module_of(device_type: str) -> Any:
    """torch's module for `device_type` (torch.xpu, ...), or None where torch has none."""
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):  # a device type torch has no module for here
        return None


def _device_name(module: Any, index: int) -> str:
    try:
        return str(module.get_device_name(index))
    except Exception:  # noqa: BLE001 - only a label; not every device module has one
        return ""


def _chosen_indices() -> list[int]:
    spec = os.environ.get(ENV_DEVICE_INDICES, "")
    return [int(part) for part in spec.split(",") if part.strip()]


def amp_precisions(device_type: str) -> tuple[str, ...]:
    """The lower precisions torch's autocast takes on `device_type`, as its device module
    says (`get_amp_supported_dtype`, which torch.autocast asks too); the family's
    table where the module does not say."""
    module = device_module_of(device_type)
    supported = getattr(module, "get_amp_supported_dtype", None)
    if supported is None:
        return family_of(device_type).precisions
    dtypes = supported()
    return tuple(name for name, dtype in _PRECISION_DTYPES.items() if dtype in dtypes)


# -- finding the devices without starting them ------------------------------------
# The two probes below are what torch answers; the suite makes them answer as an
# XPU, NPU, Mac (...) machine's torch does.


def torch_accelerator() -> str | None:
    """The device type of this process's accelerator as torch reports it ("cuda" for
    CUDA and ROCm, "xpu", "mps", a PrivateUse1 device's name), or None on a CPU build.

    torch answers from how it was built and which device plugins are loaded,
    without starting a device runtime (it does not poison fork).
    """
    found = torch.accelerator.current_accelerator()
    kind = None if found is None else found.type
    # A CUDA build reports "cuda" even where an out-of-tree device (PrivateUse1) is
    # registered and no GPU is visible: then that device is this process's accelerator.
    # torch.cuda.device_count() asks NVML first, so it does not poison fork either.
    private = torch._C._get_privateuse1_backend_name()
    if kind == "cuda" and private != "privateuseone" and torch.cuda.device_count() == 0:
        return private if device_module_of(private) is not None else kind
    return kind


def accelerator_device_count(device_type: str) -> int:
    """How many `device_type` devices this process sees, asked of torch's module for it."""
    return int(torch.get_device_module(device_type).device_count())


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def import_device_packages() -> dict[str, str]:
    """Import each installed package that brings a device family to torch (torch_npu,
    torch_mlu, ...) and is not imported yet: torch reports their devices only then.
    Returns {package: why it failed} for those that could not be imported.

    A device package that torch does not load by itself (no `torch.backends`
    entry point) is named in NOTEBOOK_ACCEL_DEVICE_PACKAGE, and imported too.
    """
    failed = {}
    named = os.environ.get(ENV_DEVICE_PACKAGE, "")
    packages = [family.package for family in FAMILIES.values() if family.package]
    for package in [*packages, *([named] if named else [])]:
        if package in sys.modules:
            continue
        if not _installed(package):
            if package == named:
                failed[package] = f"ModuleNotFoundError: no module named {package!r}"
            continue
        error = import_error(package)
        if error:
            failed[package] = error
    return failed


def import_error(package: str) -> str:
    """Import `package`; "" when that worked, else the error in words."""
    try:
        importlib.import_module(package)
    except Exception as error:  # noqa: BLE001 - a broken device runtime raises anything
        return f"{type(error).__name__}: {error}"
    return ""


def detect_accelerators() -> AcceleratorDevices | None:
    """The devices of the `torch.accelerator` type of this process other than CUDA
    (which is counted through NVML), or None. Starts no runtime where the device's
    count does not."""
    failed = import_device_packages()
    device_type = torch_accelerator()
    if device_type in (None, "cuda"):
        if not failed:
            return None
        package, why = next(iter(failed.items()))
        family = next((f for f in FAMILIES.values() if f.package == package), None)
        return AcceleratorDevices(
            family.device_type if family is not None else package,
            package=package,
            problem=f"its package {package} failed to import ({why})",
        )
    count = accelerator_device_count(device_type)
    family = family_of(device_type)
    module = device_module_of(device_type)
    return AcceleratorDevices(
        device_type,
        count=count,
        name=_device_name(module, 0) if count and device_type not in FAMILIES else "",
        precisions=amp_precisions(device_type),
        package=family.package or registering_package(module),
    )


def registering_package(module: Any) -> str:
    """The top-level package of an out-of-tree device's module (so a fresh worker can
    import it), or "" for torch's own."""
    name = getattr(module, "__name__", "") or ""
    top = name.partition(".")[0]
    return "" if top in ("", "torch") else top


def offered_here(hardware: Hardware) -> str:
    """What this machine offers, for messages that refuse a backend it lacks."""
    offered = []
    if hardware.gpus:
        offered.append(f"backend='cuda' ({len(hardware.gpus)} GPU(s))")
    if hardware.tpu_cores:
        offered.append(f"backend='xla' ({hardware.tpu_cores} TPU core(s))")
    found = hardware.usable_accelerators
    if found is not None:
        offered.append(f"backend={found.device_type!r} ({found.count} device(s))")
    offered.append(f"backend='cpu' ({hardware.cpu_cores} core(s))")
    return ", ".join(offered)
