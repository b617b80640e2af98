"""Accelerate's `accelerate.logging` path: `get_logger`, a logger that knows its process.

The public path of `notebook_accel.reporting.logging`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    name: "notebook_accel.reporting.logging" for name in ("get_logger", "MultiProcessAdapter")
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
