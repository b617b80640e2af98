"""Every public name is documented and importable from the package."""

from __future__ import annotations

import inspect

import notebook_accel


def test_every_public_name_and_its_public_members_have_docstrings():
    missing = []
    for name in notebook_accel.__all__:
        obj = getattr(notebook_accel, name)
        if not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            for attribute, value in vars(obj).items():
                documented = callable(value) or isinstance(value, property)
                if not attribute.startswith("_") and documented and not inspect.getdoc(value):
                    missing.append(f"{name}.{attribute}")
    assert missing == []


def test_accelerate_names_a_ported_notebook_imports_are_here():
    for name in (
        "Accelerator",
        "notebook_launcher",
        "DataLoaderConfiguration",
        "AutocastKwargs",
        "GradScalerKwargs",
        "DistributedDataParallelKwargs",
        "InitProcessGroupKwargs",
        "ProjectConfiguration",
        "FullyShardedDataParallelPlugin",
        "set_seed",
        "get_logger",
    ):
        assert name in notebook_accel.__all__, name
