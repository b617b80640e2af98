"""Optional dependencies: import them where a feature needs them, or say what to install.

transformers, peft, tokenizers and torchdata are not needed to train plain
PyTorch models; the features that use them import them through `require`, so
a missing one fails with the pip line that fixes it, not a bare
`ModuleNotFoundError` from deep inside a worker.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> the pip package that provides it
_PIP_NAMES = {
    "transformers": "transformers",
    "peft": "peft",
    "tokenizers": "tokenizers",
    "torchdata": "torchdata",
}
LLM_EXTRA = "pip install 'notebook-accel[llm]'"


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed (the message says what to run)."""


def require(module: str, feature: str) -> ModuleType:
    """Import `module` (a dotted name is fine), or raise `MissingDependencyError` for `feature`.

    Args:
        module: what to import, e.g. "torchdata.stateful_dataloader".
        feature: what needs it, for the message, e.g. "use_stateful_dataloader=True".
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        package = _PIP_NAMES.get(top, top)
        # An installed package that fails to import for another reason keeps its own error.
        if getattr(error, "name", None) not in (None, top, module):
            raise
        raise MissingDependencyError(
            f"{feature} needs the {package!r} package, which is not installed: run "
            f"`pip install {package}` (or `{LLM_EXTRA}` for transformers, peft, tokenizers "
            "and torchdata together), then restart the kernel.",
            name=top,
        ) from error


def is_available(module: str) -> bool:
    """Whether `module` can be imported (without importing it when it is not loaded yet)."""
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
