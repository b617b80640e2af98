"""Apple's MPS: the Mac's GPU, one device driven by one process.

torch.distributed has no backend for MPS tensors, so a launch runs one
process (the kernel itself, as `num_processes=1` does everywhere); more is
refused with the way to N CPU workers. The rest (autocast, memory, seeding)
is the generic accelerator platform's.
"""

from __future__ import annotations

from typing import Any

import torch

from notebook_accel.platforms.accelerator import AcceleratorPlatform
from notebook_accel.platforms.hardware import Hardware


class MpsPlatform(AcceleratorPlatform):
    """The Mac's GPU, in the launching process."""

    chooses_devices = False
    supports_multinode = False
    wraps_model_in_ddp = False

    def __init__(self) -> None:
        super().__init__("mps")
        self.device_noun = "MPS device"

    def devices_summary(self, hardware: Hardware) -> str:
        return (
            "Apple's MPS is one GPU, driven by one process; for several CPU workers pass "
            "backend='cpu'"
        )

    def processes_for(self, hardware: Hardware, devices: list[int], asked: int) -> int:
        return 1  # the one process that drives the GPU

    def precision_problem(self, precision: str, hardware: Hardware) -> str | None:
        problem = super().precision_problem(precision, hardware)
        if problem is None and precision == "bf16" and not _macos_14_or_newer():
            return "bf16 on MPS needs macOS 14 or newer; use mixed_precision='fp16'"
        return problem

    def fork_problem(self) -> str | None:
        return None  # no worker is ever forked: the one process is this one

    def device(self, local_rank: int) -> torch.device:
        return torch.device("mps")

    def copy_stream(self, device: torch.device) -> Any:
        return None  # MPS has one queue per process

    def manual_seed(self, seed: int) -> None:
        if torch.backends.mps.is_available():
            torch.mps.manual_seed(seed)

    def rng_states(self) -> dict[str, Any]:
        if not torch.backends.mps.is_available():
            return {}
        return {"mps": torch.mps.get_rng_state()}

    def set_rng_states(self, states: dict[str, Any]) -> None:
        if "mps" in states and torch.backends.mps.is_available():
            torch.mps.set_rng_state(states["mps"])

    def runtime_initialised(self) -> bool:
        return torch.backends.mps.is_available()

    def peak_device_bytes(self) -> int | None:
        return torch.mps.driver_allocated_memory() if torch.backends.mps.is_available() else None

    def empty_cache(self) -> None:
        if torch.backends.mps.is_available():
            torch.mps.empty_cache()


def _macos_14_or_newer() -> bool:
    check = getattr(torch.backends.mps, "is_macos_or_newer", None)
    try:
        return bool(check is not None and check(14, 0))
    except RuntimeError:  # a torch without MPS
        return False
