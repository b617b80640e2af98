"""Seeding every random number generator a training run touches."""

from __future__ import annotations

import os
import random


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy (when installed) and torch on every device.

    With `device_specific=True` each process adds its rank to `seed`, so
    processes draw different numbers (for example for dropout or augmentation).
    With `deterministic=True` torch is asked to use deterministic algorithms.
    """
    import torch
    import torch.distributed as dist

    if device_specific:
        if dist.is_available() and dist.is_initialized():
            seed += dist.get_rank()
        else:
            seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)
