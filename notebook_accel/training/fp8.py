"""fp8 training through torchao's float8 Linear layers, only where it pays.

A float8 matmul runs at up to twice bf16's rate on Ada and Hopper GPUs, but a
float8 layer first scales and casts its input, its weight and, in backward,
its output gradient. Per token, the matmul time saved grows with K*N (the
layer's two sizes) while the casts read and write K+N values; for a small
layer the casts cost more than the matmul saves. Without a compiler the casts
are many separate kernels: 4 layers of 8192 x 8192 on an H200 trained at 0.60x
of bf16 in eager mode and at 1.32x compiled with inductor. So by default:

- a Linear layer becomes float8 when both its sizes are multiples of 16 (what
  float8 matmuls need) and K*N/(K+N) >= `FP8_MIN_SIZE` (square layers from
  3072 wide, 2048 x 8192, 4096 x 4096 and larger; a roofline estimate for an
  H100 puts the break-even near 1024 and fp8 must never be slower than bf16);
- the float8 layers are compiled with inductor, one by one, so the casts fuse
  (unless `prepare` compiles the whole model anyway);
- without a compiler every layer stays in bf16;
- the layers that stay in bf16, and why, are named once, in a warning.

`AORecipeKwargs(module_filter_func=...)` chooses the layers instead; they are
converted even without a compiler (the warning then says what that costs).

Everything else runs under bf16 autocast, as with mixed_precision="bf16".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from notebook_accel.config.kwargs import AORecipeKwargs

# Below this K*N/(K+N), casting costs about what float8 saves (see the module docstring).
FP8_MIN_SIZE = 1536
_ALIGNMENT = 16  # torch._scaled_mm needs both sizes divisible by 16


def layer_problem(layer: torch.nn.Linear) -> str | None:
    """Why `layer` should stay in bf16 under fp8, or None when float8 pays for it."""
    k, n = layer.in_features, layer.out_features
    if k % _ALIGNMENT or n % _ALIGNMENT:
        return f"sizes not multiples of {_ALIGNMENT}"
    if k * n / (k + n) < FP8_MIN_SIZE:
        return "too small for float8 to pay"
    return None


@dataclass
class Float8Plan:
    """Which Linear layers of a model become float8, which stay in bf16 and why."""

    convert: list[str] = field(default_factory=list)
    keep: dict[str, str] = field(default_factory=dict)  # layer name -> reason
    compile_layers: bool = False
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    uncompiled: str | None = None  # why the chosen float8 layers run without a compiler

    def message(self) -> str | None:
        """One line naming the layers kept in bf16 (grouped by reason), or None."""
        if self.uncompiled:
            return (
                f"fp8: the {len(self.convert)} float8 layers module_filter_func chose run "
                f"uncompiled, slower than bf16 ({self.uncompiled})."
            )
        if not self.keep:
            return None
        total = len(self.convert) + len(self.keep)
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.keep.items():
            by_reason.setdefault(reason, []).append(name)
        parts = [f"{reason}: {_names(names, self.sizes)}" for reason, names in by_reason.items()]
        head = f"fp8: {len(self.keep)} of {total} Linear layers kept in bf16"
        if not self.convert:
            head = f"fp8: all {total} Linear layers kept in bf16, none trains in float8"
        return head + " (" + "; ".join(parts) + ")."


def _names(names: list[str], sizes: dict[str, tuple[int, int]], shown: int = 4) -> str:
    listed = [f"{name or '<model>'} {sizes[name][0]}x{sizes[name][1]}" for name in names[:shown]]
    more = len(names) - shown
    return ", ".join(listed) + (f" and {more} more" if more > 0 else "")


def plan_layers(
    model: torch.nn.Module,
    module_filter: Callable[[torch.nn.Module, str], bool] | None = None,
    compile_problem: str | None = None,
    model_compiled: bool = False,
) -> Float8Plan:
    """Decide, without torchao, which Linear layers of `model` become float8.

    `module_filter` (the person's choice) replaces the size rule. `compile_problem`
    says why inductor cannot compile here (then, without `module_filter`, nothing is
    converted: eager float8 is slower than bf16). `model_compiled`: `prepare`
    compiles the whole model, so the layers need no compiling of their own.
    """
    plan = Float8Plan(compile_layers=not model_compiled and compile_problem is None)
    # MultiheadAttention multiplies by its out_proj's weight itself, never calling
    # the layer: a float8 layer there would never run.
    attention = {
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.MultiheadAttention)
        for child, _ in module.named_children()
    }
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name in attention:
            continue
        plan.sizes[name] = (module.in_features, module.out_features)
        if module_filter is not None:
            reason = None if module_filter(module, name) else "left out by module_filter_func"
        else:
            reason = layer_problem(module)
        if reason is None:
            plan.convert.append(name)
        else:
            plan.keep[name] = reason
    if plan.compile_layers or model_compiled or not plan.convert:
        return plan
    if module_filter is not None:  # the person's choice stands; say what it costs
        plan.uncompiled = compile_problem
        return plan
    reason = f"no compiler to fuse float8's casts ({compile_problem})"
    plan.keep.update(dict.fromkeys(plan.convert, reason))
    plan.convert = []
    return plan


def convert(
    model: torch.nn.Module, plan: Float8Plan, recipe: AORecipeKwargs, sharded: bool = False
) -> torch.nn.Module:
    """Swap the plan's layers for torchao's `Float8Linear` and compile them.

    Returns the model (a new object only when the model itself is one Linear).
    Raises RuntimeError when a planned layer did not become float8, rather than
    training on in bf16 while saying fp8.
    """
    if not plan.convert:
        return model
    from torchao.float8 import convert_to_float8_training

    config = recipe.float8_config(sharded=sharded)
    _check_alignment(plan, config)
    chosen = set(plan.convert)
    model = convert_to_float8_training(
        model, module_filter_fn=lambda module, name: name in chosen, config=config
    )
    layers = {name: model.get_submodule(name) for name in plan.convert}
    missed = [name for name, layer in layers.items() if not is_float8_layer(layer)]
    if missed:
        raise RuntimeError(
            f"fp8: torchao left {_names(missed, plan.sizes)} as plain Linear layers; "
            "check the torchao version (pip install -U torchao) or use mixed_precision='bf16'."
        )
    if plan.compile_layers:
        _allow_recompiles(len({plan.sizes[name] for name in plan.convert}))
        for layer in layers.values():
            # In place: the module keeps its class and its parameter names.
            layer.compile(backend="inductor")
    model._notebook_accel_float8 = config  # what refresh_scales_after_steps() reads
    return model


def _allow_recompiles(shapes: int) -> None:
    """Let every float8 layer stay compiled.

    Layers of one shape share their compiled code; each other shape (weights
    have static shapes to the compiler), evaluation without gradients, and a
    batch of another size add an entry to the one cache of Float8Linear.forward.
    Past torch's limit (8) the compiler silently runs the rest eagerly, where
    float8 is slower than bf16: so the limit is raised (never lowered) to 4
    entries per shape.
    """
    from notebook_accel.internals.dynamo import raise_recompile_limit

    raise_recompile_limit(4 * shapes)


def _check_alignment(plan: Float8Plan, config: Any) -> None:
    if getattr(config, "pad_inner_dim", False):
        return
    odd = [name for name in plan.convert if any(s % _ALIGNMENT for s in plan.sizes[name])]
    if odd:
        raise ValueError(
            f"fp8: module_filter_func chose {_names(odd, plan.sizes)}, whose sizes are not "
            f"multiples of {_ALIGNMENT}, which float8 matmuls need. Leave them out, or pass "
            "AORecipeKwargs(pad_inner_dim=True) to pad them."
        )


def is_float8_layer(module: torch.nn.Module) -> bool:
    """True for torchao's `Float8Linear` (looked up by name: torchao may be absent)."""
    return any(cls.__name__ == "Float8Linear" for cls in type(module).__mro__)


def float8_layers(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s float8 layers."""
    return [name for name, module in model.named_modules() if is_float8_layer(module)]


def refresh_scales_after_steps(models: list, optimizers: list) -> None:
    """Under FSDP2 with float8 all-gather, compute the next step's weight scales for
    every shard at once after each real optimizer step (one all-reduce instead of
    one per layer), as torchao advises. Hooks each optimizer once per model whose
    parameters it holds; `models` and `optimizers` are the prepared ones."""
    from notebook_accel.training.compile import unwrap_compiled

    for model in models:
        model = unwrap_compiled(model)
        config = getattr(model, "_notebook_accel_float8", None)
        if config is None or not getattr(config, "enable_fsdp_float8_all_gather", False):
            continue
        own = {id(p) for p in model.parameters()}
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's
            hooked = inner.__dict__.setdefault("_notebook_accel_float8_models", set())
            holds = any(id(p) in own for group in inner.param_groups for p in group["params"])
            if holds and id(model) not in hooked:
                hooked.add(id(model))
                inner.register_step_post_hook(_scale_refresher(model))


def _scale_refresher(model: torch.nn.Module) -> Callable[..., None]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def refresh(*args: Any, **kwargs: Any) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    return refresh
