"""Seeding every random number generator a training run touches, and saving their states."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator


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
    from notebook_accel.platforms.registry import PLATFORMS

    torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    for platform in PLATFORMS.values():
        platform.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def rng_states() -> dict:
    """The state of every random number generator this process uses.

    Python's `random`, NumPy's global generator (when NumPy is installed),
    torch's CPU generator and, when CUDA is in use, every CUDA generator.
    """
    import torch

    from notebook_accel.platforms.registry import PLATFORMS

    states: dict = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    for platform in PLATFORMS.values():  # the devices in use (none is started here)
        states.update(platform.rng_states())
    return states


def set_rng_states(states: dict) -> None:
    """Put back generator states taken by `rng_states()`."""
    import torch

    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in states:
        numpy.random.set_state(states["numpy"])
    from notebook_accel.platforms.registry import PLATFORMS

    for platform in PLATFORMS.values():
        platform.set_rng_states(states)


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Run the block without moving any random number generator forward."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy
