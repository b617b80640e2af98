"""Tensor parallelism in `prepare()`: split a model over the mesh's "tp" dimension.

A model may come split already (transformers' `from_pretrained(..., tp_plan="auto",
device_mesh=...)`, or the user's own `parallelize_module` call); otherwise `prepare()`
splits it with torch's `parallelize_module`, by the plan given to it (`tp_plan=`) or by
the model's own (a transformers model carries one, `model.tp_plan`). A plan maps module
names, with `*` for any one name ("model.layers.*.mlp.up_proj"), to torch's styles
(`ColwiseParallel()`, `RowwiseParallel()`, ...) or to transformers' names for the
common ones (`STYLE_NAMES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

import torch

from notebook_accel.training.fsdp import ShardMap


def _style(kind: str, *whole: str) -> Callable[[], Any]:
    """A maker of torch's `kind` style whose `whole` layouts ("input_layouts",
    "output_layouts") are replicated rather than split."""

    def make() -> Any:
        from torch.distributed.tensor import Replicate, parallel

        return getattr(parallel, kind)(**{layout: Replicate() for layout in whole})

    return make


# transformers' names for the styles its dense models use, as torch's styles.
STYLE_NAMES: dict[str, Callable[[], Any]] = {
    # outputs split: each rank computes some of the features
    "colwise": _style("ColwiseParallel"),
    # inputs split: each rank's partial sums are added over the ranks
    "rowwise": _style("RowwiseParallel"),
    # outputs split, then gathered whole (an output layer's logits)
    "colwise_rep": _style("ColwiseParallel", "output_layouts"),
    "colwise_gather_output": _style("ColwiseParallel", "output_layouts"),
    # whole inputs, split on the way in
    "rowwise_rep": _style("RowwiseParallel", "input_layouts"),
    # an embedding's vocabulary rows split; the token ids come whole
    "embedding_rowwise": _style("RowwiseParallel", "input_layouts"),
}


def plan_for(
    model: torch.nn.Module, tp_size: int, plan: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The styles to split `model` by (`plan`, or the model's own), checked against it
    before anything is split; None when the model comes split already."""
    if is_split(model):
        if plan is not None:
            raise ValueError(
                f"{type(model).__name__} is split over tp already; pass tp_plan= only for "
                "a model that is not."
            )
        return None
    styles = _styles(model, plan)
    _check_targets(model, styles, plan is not None)
    _check_heads(model, tp_size)
    _check_even(model, styles, tp_size)
    return styles


def split_model(model: torch.nn.Module, mesh: Any, styles: dict[str, Any]) -> ShardMap:
    """Split `model` in place over the 1-D `mesh` ("tp") by `styles` (from `plan_for`);
    the returned map says which new parameter replaced which, for the optimizers."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied_names(model)
    before = dict(model.named_parameters())
    parallelize_module(model, mesh, styles)
    _tie_again(model, tied)
    shards = ShardMap()
    for name, parameter in model.named_parameters():
        if before[name] is not parameter:
            shards.add(before[name], parameter)
    return shards


def is_split(model: torch.nn.Module) -> bool:
    """Whether a parameter of `model` is a DTensor split over a "tp" dimension."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        for p in model.parameters()
    )


def model_plan(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's own plan: transformers' `tp_plan` (`_tp_plan` before 5.0)."""
    for attribute in ("tp_plan", "_tp_plan"):
        plan = getattr(model, attribute, None)
        if isinstance(plan, Mapping) and plan:
            return dict(plan)
    return None


def _styles(model: torch.nn.Module, plan: Mapping[str, Any] | None) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ParallelStyle

    chosen = plan if plan is not None else model_plan(model)
    if not chosen:
        raise ValueError(
            f"tp_size > 1, but {type(model).__name__} is not split over the tp dimension "
            "and has no tp_plan of its own. Give prepare() a plan, e.g. "
            'accelerator.prepare(model, optimizer, tp_plan={"fc1": ColwiseParallel(), '
            '"fc2": RowwiseParallel()}) with torch.distributed.tensor.parallel\'s styles, '
            "or split it yourself before prepare(): parallelize_module(model, "
            'accelerator.torch_device_mesh["tp"], plan), or for a transformers model '
            'from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh["tp"]).'
        )
    styles = {}
    for name, style in chosen.items():
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif isinstance(style, str) and style in STYLE_NAMES:
            styles[name] = STYLE_NAMES[style]()
        else:
            raise ValueError(
                f"tp_plan[{name!r}] = {style!r}: give one of torch's styles "
                "(torch.distributed.tensor.parallel.ColwiseParallel(), RowwiseParallel(), "
                f"...) or one of {sorted(STYLE_NAMES)}; for transformers' other styles load "
                'the model with from_pretrained(..., tp_plan="auto", '
                'device_mesh=accelerator.torch_device_mesh["tp"]).'
            )
    return styles


def _check_targets(model: torch.nn.Module, styles: dict[str, Any], given: bool) -> None:
    """Every key of a plan the user gave names a module (torch only warns and goes on)."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [key for key in styles if not any(_matches(name, key) for name in names)]
    if unmatched and given:
        raise ValueError(
            f"tp_plan names no module of {type(model).__name__}: {unmatched}. Keys are "
            "module names as model.named_modules() gives them, with * for any one name "
            '("layers.*.mlp.up_proj").'
        )
    if len(unmatched) == len(styles):
        raise ValueError(
            f"{type(model).__name__}'s own tp_plan names none of its modules ({list(styles)}); "
            "give prepare() a plan: tp_plan={...}."
        )


def _matches(name: str, key: str) -> bool:
    parts, pattern = name.split("."), key.split(".")
    return len(parts) == len(pattern) and all(map(fnmatch, parts, pattern))


def _check_heads(model: torch.nn.Module, tp_size: int) -> None:
    """Attention splits by whole heads: a transformers config's head counts must divide."""
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attribute, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(
                f"{type(model).__name__} has {attribute}={heads}, which does not split "
                f"over tp_size={tp_size}: choose a tp_size that divides it."
            )


def _check_even(model: torch.nn.Module, styles: dict[str, Any], tp_size: int) -> None:
    """The features a style splits divide into equal parts: torch takes a split input's
    whole size as its local size times the ranks, so uneven parts fail at the first
    forward with a shape error that names no module."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, module in model.named_modules():
        style = next((s for key, s in styles.items() if name and _matches(name, key)), None)
        weight = getattr(module, "weight", None)
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)) or weight is None:
            continue
        embedding = isinstance(module, torch.nn.Embedding)
        # a Linear's weight is (outputs, inputs); an Embedding's (vocabulary, features)
        dim = 0 if isinstance(style, ColwiseParallel) != embedding else 1
        if weight.shape[dim] % tp_size:
            raise ValueError(
                f"{name}: {type(style).__name__} splits its {weight.shape[dim]} "
                f"{'rows' if dim == 0 else 'columns'} of weight, which do not divide into "
                f"tp_size={tp_size} equal parts: choose a tp_size that divides it, or leave "
                "the module out of the plan."
            )


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied input and output embeddings)."""
    owners: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), []).append(name)
    return [names for names in owners.values() if len(names) > 1]


def _tie_again(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """Splitting gives each module its own new parameter; tied ones share the first
    again, where the plan split them alike (an embedding and the output layer, both by
    vocabulary rows)."""
    for names in tied:
        parameters = [model.get_parameter(name) for name in names]
        first = parameters[0]
        layouts = {str(getattr(p, "placements", None)) for p in parameters}
        if len(layouts) > 1:
            raise ValueError(
                f"{names} are one tied parameter, but the plan splits them differently "
                f"({sorted(layouts)}): split them alike, or leave them all out of the plan."
            )
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, first)
