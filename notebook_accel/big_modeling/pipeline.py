"""prepare_pippy: pipelined inference with one stage of the model per launched worker.

Built on `torch.distributed.pipelining`: `pipeline()` traces the model (torch.export)
and splits it at the split points; `ScheduleGPipe` runs the micro-batches through the
stages. The first worker feeds the batch, the last one gets the output; with
`gather_output=True` every worker gets it (so the launcher returns it to the kernel).

What traces (checked with torch 2.13 on CPU workers over gloo): plain `nn.Module`
models, and transformers' GPT-2 and Llama causal LMs built from a config with
`use_cache=False`. A model the tracer cannot export fails with the tracer's error;
an `nn.Sequential` is then split by its children instead (a `PipelineStage` per
worker), which needs no tracing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from notebook_accel.big_modeling.device_map import infer_auto_device_map
from notebook_accel.big_modeling.memory import calculate_maximum_sizes
from notebook_accel.training.nested import apply_to_tensors


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    found: list[int] = []
    apply_to_tensors(lambda t: found.append(t.shape[0]) if t.dim() else None, (args, kwargs))
    return found[0] if found else None


def auto_split_points(
    model: nn.Module, num_stages: int, no_split_module_classes: Iterable[str] | None = None
) -> list[str]:
    """Module names where stages 1..num_stages-1 begin, balancing the model's size."""
    total, (largest, _) = calculate_maximum_sizes(model)
    share = math.ceil((total + largest) / num_stages * 1.1)
    device_map = infer_auto_device_map(
        model,
        max_memory=dict.fromkeys(range(num_stages), share),
        no_split_module_classes=no_split_module_classes,
        clean_result=False,
    )
    points = []
    for stage in range(1, num_stages):
        first = next((name for name, device in device_map.items() if device == stage), None)
        if first is None:
            raise ValueError(
                f"the model is too small to split into {num_stages} stages: pass split_points "
                "or launch fewer workers"
            )
        is_module = isinstance(_get(model, first), nn.Module)
        points.append(first if is_module else first.rpartition(".")[0])
    return points


def _get(model: nn.Module, name: str) -> Any:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return getattr(module, leaf)


def _first_micro_batch(data: Any, chunks: int) -> Any:
    return apply_to_tensors(lambda t: torch.tensor_split(t, chunks)[0] if t.dim() else t, data)


def _pad(data: Any, batch: int, chunks: int) -> Any:
    """Repeat the last sample so the batch splits into `chunks` equal micro-batches."""
    extra = -batch % chunks
    if not extra:
        return data
    return apply_to_tensors(
        lambda t: torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]) if t.dim() else t, data
    )


def _build_stage(model, split_points, args, kwargs, rank, world, device):
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():
            # torch's own pytree deprecation notice, raised inside its tracer
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            pipe = pipeline(
                model,
                mb_args=args,
                mb_kwargs=kwargs or None,
                split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING),
            )
        return pipe.build_stage(rank, device=device)
    except Exception:
        if not isinstance(model, nn.Sequential):
            raise
    return _sequential_stage(model, split_points, rank, world, device)


def _sequential_stage(model: nn.Sequential, split_points, rank, world, device):
    """A stage of an `nn.Sequential` cut at `split_points` (its children's names)."""
    from torch.distributed.pipelining import PipelineStage

    names = [name for name, _ in model.named_children()]
    cuts = [0, *(names.index(point.split(".")[0]) for point in split_points), len(names)]
    part = nn.Sequential(*list(model.children())[cuts[rank] : cuts[rank + 1]]).to(device)
    return PipelineStage(part, stage_index=rank, num_stages=world, device=device)


def prepare_pippy(
    model: nn.Module,
    split_points: str | list[str] = "auto",
    no_split_module_classes: Iterable[str] | None = None,
    example_args: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool = False,
) -> nn.Module:
    """Make `model(...)` run as a pipeline over the launch's workers (call it in each).

    Args:
        model: the same model on every worker (built and loaded the same way).
        split_points: "auto" (stages of about equal size) or the module names where
            stages 2, 3, ... begin (one fewer than the workers).
        no_split_module_classes: blocks "auto" never cuts through.
        example_args: an example batch, on the CPU; the model is traced with one
            micro-batch of it.
        example_kwargs: the example batch's keyword arguments, traced likewise; they
            must then be given on every call.
        num_chunks: micro-batches per batch (default: the number of workers). A batch
            that does not split evenly is padded with its last sample, and the padding
            is dropped from the output.
        gather_output: give the output to every worker, not only the last one.

    Returns:
        `model`, whose forward now runs the pipeline: the first worker's inputs are
        used; the last worker (every worker with `gather_output`) gets the output,
        the others None. In one process the model runs as it is.
    """
    from notebook_accel.training.state import PartialState

    state = PartialState()
    world, rank = state.num_processes, state.process_index
    chunks = num_chunks or world
    original = model.forward
    if world == 1:
        return model
    if split_points == "auto":
        split_points = auto_split_points(model, world, no_split_module_classes)
    if len(split_points) != world - 1:
        raise ValueError(
            f"{len(split_points)} split points make {len(split_points) + 1} stages, but "
            f"there are {world} workers: give {world - 1}"
        )
    example = _first_micro_batch((tuple(example_args), dict(example_kwargs or {})), chunks)
    stage = _build_stage(model, list(split_points), *example, rank, world, state.device)
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = ScheduleGPipe(stage, chunks)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # The first stage runs on this worker's device: inputs given on the CPU go there.
        args, kwargs = apply_to_tensors(lambda t: t.to(state.device), (args, kwargs))
        return _run(schedule, rank, world, chunks, gather_output, args, kwargs)

    model._original_forward = original
    model.pippy_stage = schedule
    model.hf_split_points = list(split_points)
    model.forward = forward
    return model


def _run(schedule, rank, world, chunks, gather_output, args, kwargs) -> Any:
    from notebook_accel.training import ops

    size = [None]
    with torch.no_grad():
        if rank == 0:
            batch = _batch_size(args, kwargs)
            if batch is None:
                raise ValueError("the pipeline found no batch dimension in the inputs")
            size = [batch]
            args, kwargs = _pad((args, kwargs), batch, chunks)
            schedule.step(*args, **kwargs)
        output = schedule.step() if rank == world - 1 else None
        if 0 < rank < world - 1:
            schedule.step()
    ops.broadcast_object_list(size, from_process=0)
    if output is not None:
        output = apply_to_tensors(lambda t: t[: size[0]], output)
    if gather_output:
        box = [output]
        ops.broadcast_object_list(box, from_process=world - 1)
        output = box[0]
    return output
