"""Accelerate's `accelerate.tracking` path: `GeneralTracker` and the trackers for `log_with`.

The public path of `notebook_accel.accelerator.tracking`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    name: "notebook_accel.accelerator.tracking"
    for name in (
        "LoggerType",
        "GeneralTracker",
        "TensorBoardTracker",
        "WandBTracker",
        "TrackioTracker",
        "CometMLTracker",
        "AimTracker",
        "MLflowTracker",
        "ClearMLTracker",
        "DVCLiveTracker",
        "SwanLabTracker",
        "get_available_trackers",
        "register_tracker_class",
        "LOGGER_TYPE_TO_CLASS",
    )
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
