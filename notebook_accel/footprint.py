"""What a training process holds in memory: parameters, gradients, optimizer state.

The public path of `notebook_accel.training.footprint`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    name: "notebook_accel.training.footprint"
    for name in ("MemoryFootprint", "training_footprint", "footprint_table")
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
