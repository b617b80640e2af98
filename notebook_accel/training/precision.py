"""Mixed precision: autocast, fp16 loss scaling, and fp8 through torchao.

`Precision` is built once per Accelerator. It refuses a precision the device
cannot do when it is built, so the error comes before any training starts.
Which layers fp8 converts, and how, is `notebook_accel.training.fp8`'s job.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch

from notebook_accel.config.kwargs import AORecipeKwargs, AutocastKwargs, GradScalerKwargs
from notebook_accel.config.settings import normalize_precision
from notebook_accel.platforms.base import Platform
from notebook_accel.training import fp8
from notebook_accel.training.nested import apply_to_tensors

# fp8 training keeps bf16 autocast for everything that is not a float8 matmul.
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


class Precision:
    """One precision setting on one device: the autocast context and the grad scaler."""

    def __init__(
        self,
        name: str | None,
        platform: Platform,
        device: torch.device,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
        ao_recipe: AORecipeKwargs | None = None,
        main_process: bool = True,
    ) -> None:
        self.name = normalize_precision(name)
        if ao_recipe is not None and self.name != "fp8":
            raise ValueError(
                f"AORecipeKwargs configures fp8 training, but mixed_precision is {self.name!r}; "
                "pass mixed_precision='fp8' or leave AORecipeKwargs out."
            )
        # The same check, and message, as the launcher's, on what this process sees.
        platform.check_precision(self.name, platform.process_hardware())
        self.platform = platform
        self.main_process = main_process
        self.ao_recipe = ao_recipe
        if self.name == "fp8" and self.ao_recipe is None:
            self.ao_recipe = AORecipeKwargs()
        self.device_type = device.type
        self.dtype = _AUTOCAST_DTYPES.get(self.name)
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self.scaler: torch.amp.GradScaler | None = None
        if self.name == "fp16":
            kwargs = (scaler_kwargs or GradScalerKwargs()).to_kwargs()
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)

    def autocast(self, handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Autocast to this precision's dtype; a no-op in full precision."""
        if self.dtype is None:
            return contextlib.nullcontext()
        kwargs = (handler or self.autocast_kwargs).to_kwargs()
        return torch.autocast(self.device_type, dtype=self.dtype, **kwargs)

    def prepare_model(
        self, model: torch.nn.Module, sharded: bool = False, compiled: bool = False
    ) -> torch.nn.Module:
        """Make `model`'s forward run in this precision and return float32 outputs.

        Under fp8 the Linear layers large enough to gain become torchao float8
        layers first (`notebook_accel.training.fp8`); `sharded`: the model will be sharded
        with FSDP2; `compiled`: `prepare` compiles the whole model.

        Like Accelerate, the original forward is kept as `model._original_forward`
        so `unwrap_model(keep_fp32_wrapper=False)` can restore it.
        """
        if self.name == "fp8":
            model = self._convert_to_float8(model, sharded, compiled)
        if self.dtype is None or hasattr(model, "_original_forward"):
            return model
        original = model.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                outputs = original(*args, **kwargs)
            return apply_to_tensors(_to_float32, outputs)

        model._original_forward = original
        model.forward = forward
        return model

    def _convert_to_float8(
        self, model: torch.nn.Module, sharded: bool, compiled: bool
    ) -> torch.nn.Module:
        assert self.ao_recipe is not None
        if fp8.float8_layers(model):  # prepared twice: converted already
            return model
        plan = fp8.plan_layers(
            model,
            self.ao_recipe.module_filter_func,
            compile_problem=self.platform.compile_problem("inductor"),
            model_compiled=compiled,
        )
        message = plan.message()
        if message and self.main_process:
            warnings.warn(message, UserWarning, stacklevel=4)
        return fp8.convert(model, plan, self.ao_recipe, sharded=sharded)


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def restore_forward(model: torch.nn.Module) -> None:
    """Undo `Precision.prepare_model`'s forward wrapper."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    del model.forward
    if getattr(original, "__func__", None) is not type(model).forward:
        model.forward = original  # the forward was itself set on the instance
