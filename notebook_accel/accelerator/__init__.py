"""The Accelerator: Accelerate's facade over training, checkpoints and reporting.

    accelerator.py  Accelerator: prepare, backward, accumulate, autocast, gather, save_state...
    tracking.py     trackers for accelerator.log (TensorBoard, wandb, ...; GeneralTracker)
    profiling.py    accelerator.profile() with ProfileKwargs (torch.profiler)
    local_sgd.py    LocalSGD; comm_hooks.py: DDP communication hooks
    batch_size.py   find_executable_batch_size, release_memory

May import: config, platforms, reporting, training, checkpoint, big_modeling.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Accelerator"]


def __getattr__(name: str) -> Any:
    # `from notebook_accel.accelerator import Accelerator` (Accelerate's accelerate.accelerator)
    if name != "Accelerator":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from notebook_accel.accelerator.accelerator import Accelerator

    return Accelerator
