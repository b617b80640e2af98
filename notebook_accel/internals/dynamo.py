"""torch.compile's wrapper (`OptimizedModule` and its `_orig_mod`, in
torch._dynamo.eval_frame) and the compiler's recompile limit (torch._dynamo.config).

torch has no public name for the compiled wrapper's class or the module it wraps;
the wrapper is only looked for once something was compiled in this process (importing
torch._dynamo costs about a second), so an uncompiled model never touches it.
"""

from __future__ import annotations

import sys

import torch

from notebook_accel.internals.api import PrivateApi, has

_EVAL_FRAME = "torch._dynamo.eval_frame"


def compiled_class() -> type | None:
    """torch.compile's wrapper class, or None when nothing was compiled here."""
    eval_frame = sys.modules.get(_EVAL_FRAME)
    return None if eval_frame is None else getattr(eval_frame, "OptimizedModule", None)


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (the model itself when it was not compiled)."""
    wrapper = compiled_class()
    while wrapper is not None and isinstance(model, wrapper):
        model = wrapped_module(model)
    return model


def wrapped_module(compiled: torch.nn.Module) -> torch.nn.Module:
    """The module the torch.compile wrapper `compiled` runs."""
    return compiled._orig_mod


def set_wrapped_module(compiled: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make the torch.compile wrapper `compiled` run `model` instead."""
    compiled._orig_mod = model


def compiled_like(compiled: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """A new torch.compile wrapper of `model` with the compile settings of `compiled`."""
    return type(compiled)(model, compiled.dynamo_ctx)


def raise_recompile_limit(at_least: int) -> None:
    """Let the compiler keep `at_least` compiled versions of a function (never lowered)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), at_least))


def _wrapper_present() -> bool:
    import torch._dynamo.eval_frame as eval_frame

    wrapper = getattr(eval_frame, "OptimizedModule", None)
    compiled = torch.compile(torch.nn.Identity())  # builds the wrapper, compiles nothing yet
    return isinstance(compiled, wrapper) and has(compiled, "_orig_mod", "dynamo_ctx")


def _limit_present() -> bool:
    import torch._dynamo

    config = torch._dynamo.config
    return has(config, "recompile_limit") or has(config, "cache_size_limit")


APIS = [
    PrivateApi(
        "torch._dynamo.eval_frame.OptimizedModule, its _orig_mod and dynamo_ctx",
        "reaching a compiled model's own module (checkpoints, DDP buckets, unwrap_model)",
        "required: a compiled model's state is read through it",
        _wrapper_present,
    ),
    PrivateApi(
        "torch._dynamo.config.recompile_limit (cache_size_limit before torch 2.6)",
        "fp8 models whose layers have many shapes staying compiled",
        "past torch's default limit the rest runs eagerly",
        lambda: (
            has(torch._dynamo.config, "recompile_limit")
            or has(torch._dynamo.config, "cache_size_limit")
        ),
    ),
]
