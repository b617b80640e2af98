"""What every concern module of the package `internals` describes itself with, and the
error it raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from notebook_accel.internals.tested_range import tested_range


class TorchInternalMissing(RuntimeError):
    """The running torch lacks a private API a feature needs."""


@dataclass(frozen=True)
class PrivateApi:
    """One private torch API: where it is, what needs it, what happens without it."""

    name: str  # "DistributedDataParallel._update_process_group"
    needed_for: str
    without_it: str  # what the package does on a torch that lacks it
    present: Callable[[], bool]


def missing_error(api: str, needed_for: str) -> TorchInternalMissing:
    """The error for a private API the running torch lacks."""
    import torch

    return TorchInternalMissing(
        f"{needed_for} needs torch's private {api}, which torch {torch.__version__} does not "
        f"have (notebook_accel is tested on {tested_range()}): install a torch in that range."
    )


def has(owner: object, *names: str) -> bool:
    """Whether `owner` has every attribute of `names`."""
    return all(hasattr(owner, name) for name in names)
