"""extract_model_from_parallel: the user's model out of its distributed wrappers."""

from __future__ import annotations

import sys

from torch import nn

from notebook_accel.internals import dynamo


def _wrapper_classes() -> tuple[type, ...]:
    """Classes that hold the model as `.module`: DDP and DataParallel, and FSDP (version 1)
    and DeepSpeed's engine where those are loaded (a model cannot be one otherwise, and
    importing them costs seconds)."""
    classes: list[type] = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None:
        classes.append(fsdp.FullyShardedDataParallel)
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "DeepSpeedEngine"):
        classes.append(deepspeed.DeepSpeedEngine)
    return tuple(classes)


def _unwrap_tree(module: nn.Module) -> nn.Module:
    """`module` without `.module` wrappers, and each of its children likewise."""
    while hasattr(module, "module") and isinstance(module.module, nn.Module):
        module = module.module
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrap_tree(child))
    return module


def extract_model_from_parallel(
    model: nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> nn.Module:
    """The model inside DDP, DataParallel, FSDP or DeepSpeed wrappers.

    Args:
        model: the wrapped model.
        keep_fp32_wrapper: keep the forward wrapper that mixed precision put on the model
            (False restores its own forward).
        keep_torch_compile: for a model compiled as a whole, return the compiled module
            around the unwrapped one (False: the unwrapped one). Submodules compiled on
            their own stay compiled.
        recursive: also replace every submodule that holds another as `.module` by it.
    """
    compiled_class = dynamo.compiled_class()
    compiled = model if compiled_class and isinstance(model, compiled_class) else None
    if compiled is not None:
        model = dynamo.wrapped_module(compiled)
    wrappers = _wrapper_classes()
    while isinstance(model, wrappers):
        model = model.module
    if recursive:
        model = _unwrap_tree(model)
    if not keep_fp32_wrapper:
        from notebook_accel.training.precision import restore_forward

        restore_forward(model)
    if compiled is not None and keep_torch_compile:
        dynamo.set_wrapped_module(compiled, model)
        return compiled
    return model
