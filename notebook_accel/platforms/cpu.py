"""CPU workers: N processes on the machine's cores, joined by gloo."""

from __future__ import annotations

import os
import shutil

from notebook_accel.platforms.base import DistributedType, Platform
from notebook_accel.platforms.hardware import Hardware


class CpuPlatform(Platform):
    """Processes on CPU cores; any number of them, sharing the cores if need be."""

    name = "cpu"
    process_group_backend = "gloo"
    distributed_type = DistributedType.MULTI_CPU
    device_noun = "CPU core"
    free_process_count = True

    def device_count(self, hardware: Hardware) -> int:
        return hardware.cpu_cores

    def offered(self, hardware: Hardware) -> bool:
        return True  # every machine has CPU cores

    def default_num_processes(self, hardware: Hardware) -> int:
        # Two workers show data parallelism at work without crowding a laptop.
        return min(2, hardware.cpu_cores)

    def oversubscription_allowed(self) -> bool:
        return True

    def compile_problem(self, backend: str) -> str | None:
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
        if backend == "inductor" and not compiler:
            return (
                "torch.compile's default backend 'inductor' generates C++ for the CPU and needs "
                "a C++ compiler (g++ or clang++; on Debian/Ubuntu: apt-get install g++), or set "
                "the CXX environment variable. Without one, use dynamo_backend='aot_eager'."
            )
        return None
