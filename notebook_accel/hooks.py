"""Accelerate's `accelerate.hooks` path: hooks around a module's forward.

The public path of the hook functions of `notebook_accel.big_modeling` (hooks.py,
dispatch.py); names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    "ModuleHook": "notebook_accel.big_modeling.hooks",
    "add_hook_to_module": "notebook_accel.big_modeling.hooks",
    "remove_hook_from_module": "notebook_accel.big_modeling.hooks",
    "remove_hook_from_submodules": "notebook_accel.big_modeling.hooks",
    "attach_align_device_hook": "notebook_accel.big_modeling.dispatch",
    "UserCpuOffloadHook": "notebook_accel.big_modeling.dispatch",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
