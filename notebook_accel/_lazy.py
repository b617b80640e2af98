"""Public names imported on first use, for the package and its re-exporting modules.

A package's `__init__` that imports its own modules can deadlock against a thread that
imports one of those modules first: each takes the module locks in the other's order
(python/cpython#83065, fixed in Python 3.15). So no `__init__` of this package imports
its own modules when it runs; they re-export through these lazy names instead.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def resolve(module_name: str, exports: dict[str, str], name: str) -> Any:
    """The public `name` of `module_name`, imported from its defining module in
    `exports` (public name -> module) and kept in the module's globals."""
    defining = exports.get(name)
    if defining is None:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(defining), name)
    vars(sys.modules[module_name])[name] = value
    return value


def lazy_exports(
    module_name: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's `__getattr__` and `__dir__` for `exports` (public name -> defining module).

    A name is imported from its module the first time it is asked for, then kept
    in the module's globals, so `import` of the module itself imports nothing.
    """
    namespace = vars(sys.modules[module_name])

    def __getattr__(name: str) -> Any:
        return resolve(module_name, exports, name)

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
