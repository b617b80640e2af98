"""Accelerate's `accelerate.state` path: `PartialState`, `AcceleratorState`, `GradientState`.

The public path of `notebook_accel.training.state`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    "PartialState": "notebook_accel.training.state",
    "AcceleratorState": "notebook_accel.training.state",
    "GradientState": "notebook_accel.training.optimizers",
    "DistributedType": "notebook_accel.platforms.base",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
