"""Accelerate's `accelerate.local_sgd` path: `LocalSGD`.

The public path of `notebook_accel.accelerator.local_sgd`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {name: "notebook_accel.accelerator.local_sgd" for name in ("LocalSGD",)}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
