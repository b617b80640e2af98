"""`torch.compile` in `prepare`, and the way back to the user's module.

`prepare` compiles after DDP or FSDP has wrapped the model, as Accelerate does;
`torch.compile` returns an `OptimizedModule` whose `_orig_mod` is what it
compiled. `unwrap_compiled` takes that layer off.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from notebook_accel.kwargs import TorchDynamoPlugin


def plugin_for(
    dynamo_backend: str | None,
    dynamo_plugin: TorchDynamoPlugin | None,
    compile: bool,
    device: torch.device,
) -> TorchDynamoPlugin | None:
    """The compile settings from the Accelerator's arguments, or None for no compiling."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ValueError("pass dynamo_backend= or dynamo_plugin=, not both.")
    if dynamo_plugin is None:
        if dynamo_backend is None:
            dynamo_backend = "inductor" if compile else "no"
        dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
    if not dynamo_plugin.enabled:
        return None
    if dynamo_plugin.backend == "inductor" and device.type == "cpu" and not _cpp_compiler():
        raise RuntimeError(
            "torch.compile's default backend 'inductor' generates C++ for the CPU and needs "
            "a C++ compiler (g++ or clang++; on Debian/Ubuntu: apt-get install g++), or set "
            "the CXX environment variable. Without one, use dynamo_backend='aot_eager'."
        )
    return dynamo_plugin


def _cpp_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def compile_model(model: torch.nn.Module, plugin: TorchDynamoPlugin) -> torch.nn.Module:
    """`torch.compile(model, ...)`; compiling happens at the first forward."""
    return torch.compile(model, **plugin.to_kwargs())


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (the model itself when it was not compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was compiled in this process (and dynamo stays unloaded)
        return model
    while isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model
