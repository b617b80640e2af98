"""Who this process is: rank, world size, device, and the platform it runs on.

The platform (platforms/) holds everything that differs between devices; it
is chosen once, when the state is built, so no other module asks "which
device is this?".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from notebook_accel import ops
from notebook_accel.config import LaunchSettings
from notebook_accel.kwargs import InitProcessGroupKwargs
from notebook_accel.platforms import PLATFORMS, DistributedType, Platform, platform_for_process

__all__ = ["DistributedType", "ProcessState"]


@dataclass(frozen=True)
class ProcessState:
    """This process's place in the run. Built by `ProcessState.create()`."""

    platform: Platform
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
        return self.platform.distributed_type if self.use_distributed else DistributedType.NO

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
        platform = _platform(cpu, launch)
        rank, world, local_rank, local_world = platform.placement()
        device = platform.device(local_rank)
        if world > 1:
            platform.join(init_kwargs or InitProcessGroupKwargs())
        ops.use_collectives(platform.collectives())
        return cls(platform, rank, world, local_rank, local_world, device)


def _platform(cpu: bool, launch: LaunchSettings | None) -> Platform:
    if cpu:
        return PLATFORMS["cpu"]
    if launch is None:
        return platform_for_process()
    if launch.backend not in PLATFORMS:
        raise NotImplementedError(
            f"The Accelerator has no {launch.backend!r} platform; "
            f"available: {', '.join(PLATFORMS)}."
        )
    return PLATFORMS[launch.backend]
