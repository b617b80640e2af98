"""Local SGD: each process steps on its own gradients, the models are averaged every few steps.

`LocalSGD` (Accelerate's `accelerate.local_sgd` name) turns off DDP's gradient
all-reduce inside its block and instead averages the parameters over the
processes every `local_sgd_steps` calls of `step()` and once more when the
block ends: less communication, for a model that drifts a little between
averages.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch

from notebook_accel.platforms.base import DistributedType


class LocalSGD:
    """Context manager: train `model` with local steps, averaging it every `local_sgd_steps`.

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                ...
                optimizer.step()
                local_sgd.step()

    With `enabled=False`, or in one process, it does nothing (DDP syncs as usual).
    """

    SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if accelerator.distributed_type not in self.SUPPORTED:
            raise NotImplementedError(
                f"LocalSGD averages DDP models on CPU or GPU processes; this run is "
                f"{accelerator.distributed_type}. Leave LocalSGD out (enabled=False)."
            )
        from notebook_accel.training import fsdp

        if fsdp.is_sharded(accelerator.unwrap_model(model)):
            raise NotImplementedError(
                "LocalSGD averages whole models; this one is sharded with FSDP, where each "
                "process holds different parameters. Use it with DDP (no fsdp_plugin)."
            )
        if enabled and (local_sgd_steps is None or int(local_sgd_steps) < 1):
            raise ValueError(f"local_sgd_steps={local_sgd_steps!r} must be 1 or more.")
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.num_steps = 0
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self.enabled and kind is None:  # after an error the peers may not get here
                self._average_parameters()
        finally:
            self._no_sync.close()

    def step(self) -> None:
        """Count a local step; average the model over the processes every `local_sgd_steps`."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for parameter in self.model.parameters():
                parameter.data = self.accelerator.reduce(parameter.data, reduction="mean")
