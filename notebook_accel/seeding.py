"""Seeding every random number generator a training run touches, and saving their states."""

from __future__ import annotations

import contextlib
import os
import random
import sys
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
    torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    xm = _xla_model()
    if xm is not None:
        xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def rng_states() -> dict:
    """The state of every random number generator this process uses.

    Python's `random`, NumPy's global generator (when NumPy is installed),
    torch's CPU generator and, when CUDA is in use, every CUDA generator.
    """
    import torch

    states: dict = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    # Only read CUDA states where CUDA is already running: reading them would start it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    xm = _xla_model()
    if xm is not None:
        states["xla"] = xm.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    """Put back generator states taken by `rng_states()`."""
    import torch

    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in states:
        numpy.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    xm = _xla_model()
    if "xla" in states and xm is not None:
        xm.set_rng_state(states["xla"])


def _xla_model():
    """torch_xla's xla_model, only where torch_xla is in use (never imported here)."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.core.xla_model as xm

    return xm


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
