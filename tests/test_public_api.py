"""Every public name is documented and importable from the package."""

from __future__ import annotations

import inspect
from types import ModuleType

import notebook_accel
from tests_support import dev_dependency


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
        "debug_launcher",
        "DataLoaderConfiguration",
        "AutocastKwargs",
        "GradScalerKwargs",
        "DistributedDataParallelKwargs",
        "InitProcessGroupKwargs",
        "ProjectConfiguration",
        "FullyShardedDataParallelPlugin",
        "ParallelismConfig",
        "set_seed",
        "get_logger",
        "init_empty_weights",
        "load_checkpoint_and_dispatch",
    ):
        assert name in notebook_accel.__all__, name


# Accelerate's top-level names that are not ours, each with its reason (docs/porting.md)
NOT_AT_THE_TOP = {
    "DeepSpeedPlugin": "DeepSpeed is not supported: FSDP2 is",
}


def test_every_name_accelerate_exports_at_its_top_is_exported_at_ours():
    accelerate = dev_dependency("accelerate")
    public = {
        name
        for name in dir(accelerate)
        if not name.startswith("_") and not isinstance(getattr(accelerate, name), ModuleType)
    }
    assert sorted(public - set(notebook_accel.__all__) - set(NOT_AT_THE_TOP)) == []


def test_the_module_paths_ported_code_and_the_docs_import_from_stay():
    # Accelerate's module paths (the import line a port changes) and our documented ones.
    from notebook_accel.accelerator import Accelerator
    from notebook_accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    from notebook_accel.footprint import MemoryFootprint, footprint_table, training_footprint
    from notebook_accel.local_sgd import LocalSGD
    from notebook_accel.logging import get_logger
    from notebook_accel.state import AcceleratorState, GradientState, PartialState
    from notebook_accel.text import PackedTokens, pack_texts, train_tokenizer
    from notebook_accel.tracking import GeneralTracker, TensorBoardTracker
    from notebook_accel.utils import find_executable_batch_size, gather, send_to_device

    assert Accelerator is notebook_accel.Accelerator
    assert get_logger is notebook_accel.get_logger
    assert PartialState is notebook_accel.PartialState
    assert AcceleratorState is notebook_accel.AcceleratorState
    assert GradientState is notebook_accel.GradientState
    for name in (
        init_empty_weights,
        load_checkpoint_and_dispatch,
        MemoryFootprint,
        footprint_table,
        training_footprint,
        LocalSGD,
        PackedTokens,
        pack_texts,
        train_tokenizer,
        GeneralTracker,
        TensorBoardTracker,
        find_executable_batch_size,
        gather,
        send_to_device,
    ):
        assert inspect.getdoc(name), name
