"""`torch.compile` in `prepare`, and the way back to the user's module.

`prepare` compiles after DDP or FSDP has wrapped the model, as Accelerate does;
`torch.compile` returns an `OptimizedModule` whose `_orig_mod` is what it
compiled. `unwrap_compiled` takes that layer off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from notebook_accel.config.kwargs import TorchDynamoPlugin
from notebook_accel.internals.dynamo import (
    compiled_class,
    compiled_like,
    original_module,
    wrapped_module,
)


def plugin_for(
    dynamo_backend: str | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    compile: bool,
    compile_problem: Callable[[str], str | None] = lambda backend: None,
) -> TorchDynamoPlugin | None:
    """The compile settings from the Accelerator's arguments, or None for no compiling."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError("pass dynamo_backend= or dynamo_plugin=, not both.")
    if dynamo_plugin is None:
        if dynamo_backend is None and compile:
            dynamo_backend = "inductor"
        # No backend given: TorchDynamoPlugin reads ACCELERATE_DYNAMO_BACKEND, as Accelerate does.
        dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
    if not dynamo_plugin.enabled:
        return None
    # The device's platform knows what its compiler backend needs (C++ on the CPU).
    problem = compile_problem(dynamo_plugin.backend)
    if problem:
        raise RuntimeError(problem)
    return dynamo_plugin


def compile_model(model: torch.nn.Module, plugin: TorchDynamoPlugin) -> torch.nn.Module:
    """`torch.compile(model, ...)`; compiling happens at the first forward."""
    return torch.compile(model, **plugin.to_kwargs())


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (the model itself when it was not compiled)."""
    return original_module(model)


def compiled_wrapper(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost `torch.compile` wrapper of `model`, or None when it is not compiled."""
    wrapper = compiled_class()  # None: nothing was compiled here (dynamo stays unloaded)
    return model if wrapper is not None and isinstance(model, wrapper) else None


def recompiled_around(compiled: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """`model` under the compile settings of `compiled`, leaving `compiled` as it is
    (Accelerate repoints the prepared one, which then bypasses its DDP wrapper)."""
    if wrapped_module(compiled) is model:
        return compiled
    return compiled_like(compiled, model)
