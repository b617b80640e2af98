"""Public names imported on first use, for the package and `notebook_accel.utils`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    module_name: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's `__getattr__` and `__dir__` for `exports` (public name -> defining module).

    A name is imported from its module the first time it is asked for, then kept
    in the module's globals, so `import` of the module itself imports nothing.
    """
    namespace = vars(sys.modules[module_name])

    def __getattr__(name: str) -> Any:
        defining = exports.get(name)
        if defining is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(defining), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
