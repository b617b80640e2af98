"""Configuration objects passed to `Accelerator`, with Accelerate's names and defaults.

They are plain dataclasses and import nothing heavy, so building one costs no
`import torch`. `to_kwargs()` returns only the fields a user changed, which is
what gets forwarded to the torch call each object configures.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import Enum
from typing import Any


class KwargsHandler:
    """Base for the `kwargs_handlers=[...]` objects: knows which fields were changed."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the class default."""
        defaults = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for `torch.autocast` (used by mixed precision and `Accelerator.autocast`)."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for `torch.amp.GradScaler` (used when `mixed_precision="fp16"`)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


class DDPCommunicationHookType(str, Enum):
    """How DDP compresses gradients before it all-reduces them (Accelerate's names).

    FP16 and BF16 cast them to half precision for the all-reduce; POWER_SGD and
    BATCHED_POWER_SGD send a low-rank approximation (torch's PowerSGD hooks).
    As a `comm_wrapper`, FP16 or BF16 also halves what PowerSGD sends.
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`, and its communication hook.

    - `comm_hook`: a `DDPCommunicationHookType` (or its name) registered on the
      DDP model: "fp16", "bf16", "power_sgd" or "batched_power_sgd"
      (torch.distributed.algorithms.ddp_comm_hooks).
    - `comm_wrapper`: "fp16" or "bf16" around a PowerSGD hook.
    - `comm_state_option`: `PowerSGDState`'s options for the PowerSGD hooks
      (`matrix_approximation_rank`, `start_powerSGD_iter`, ...).
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type(self.comm_hook, "comm_hook", tuple(DDPCommunicationHookType))
        wrappers = (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16)
        wrappers += (DDPCommunicationHookType.BF16,)
        self.comm_wrapper = _hook_type(self.comm_wrapper, "comm_wrapper", wrappers)
        powersgd = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
        if self.comm_wrapper != DDPCommunicationHookType.NO and self.comm_hook not in powersgd:
            raise ValueError(
                f"comm_wrapper={self.comm_wrapper.value!r} wraps a PowerSGD hook; with "
                f"comm_hook={self.comm_hook.value!r} use comm_hook='power_sgd' or "
                "'batched_power_sgd', or leave comm_wrapper unset."
            )
        if self.comm_state_option and self.comm_hook not in powersgd:
            raise ValueError(
                "comm_state_option configures the PowerSGD hooks; pass "
                "comm_hook='power_sgd' or 'batched_power_sgd' with it."
            )

    def to_kwargs(self) -> dict[str, Any]:
        """The changed arguments of `DistributedDataParallel` itself (not the hook's)."""
        hook_fields = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in super().to_kwargs().items() if k not in hook_fields}


def _hook_type(
    value: Any, name: str, allowed: tuple[DDPCommunicationHookType, ...]
) -> DDPCommunicationHookType:
    try:
        kind = DDPCommunicationHookType(getattr(value, "value", value))
    except ValueError:
        kind = None
    if kind not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(k.value for k in allowed)}.")
    return kind


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`.

    `backend=None` means: the backend that fits the device (gloo on CPU, nccl on CUDA).
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")


@dataclass
class ProfileKwargs(KwargsHandler):
    """What `Accelerator.profile()` records with `torch.profiler` (Accelerate's handler).

    - `activities`: "cpu", "cuda", "xpu", ... (None: torch's default, the CPU and
      whichever device is present).
    - `schedule_option`: `torch.profiler.schedule`'s arguments (`wait`, `warmup`,
      `active`, `repeat`, `skip_first`); then call `prof.step()` each step.
    - `on_trace_ready`: called with the profiler when a scheduled cycle ends.
    - `record_shapes`, `profile_memory`, `with_stack`, `with_flops`,
      `with_modules`: `torch.profiler.profile`'s switches.
    - `output_trace_dir`: each process writes its Chrome trace there when the
      block ends, as `profile_<rank>.json`.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for activity in self.activities or ():
            if str(activity).lower() not in PROFILER_ACTIVITIES:
                raise ValueError(
                    f"activities has {activity!r}; choose among {', '.join(PROFILER_ACTIVITIES)}."
                )
        allowed = {"wait", "warmup", "active", "repeat", "skip_first"}
        unknown = sorted(set(self.schedule_option or {}) - allowed)
        if unknown:
            raise ValueError(
                f"schedule_option has {unknown[0]!r}; torch.profiler.schedule takes "
                f"{', '.join(sorted(allowed))}."
            )

    def build(self) -> Any:
        """The `torch.profiler.profile` these settings describe (not started)."""
        import torch.profiler

        activities = None
        if self.activities is not None:
            known = torch.profiler.ProfilerActivity
            missing = [a for a in self.activities if not hasattr(known, str(a).upper())]
            if missing:
                raise ValueError(
                    f"this torch cannot profile {missing[0]!r}; it knows "
                    f"{', '.join(sorted(n.lower() for n in known.__members__))}."
                )
            activities = [getattr(known, str(a).upper()) for a in self.activities]
        schedule = None
        if self.schedule_option is not None:
            schedule = torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class AORecipeKwargs(KwargsHandler):
    """How `mixed_precision="fp8"` trains through torchao's float8 layers (Accelerate's handler).

    - `config`: a `torchao.float8.Float8LinearConfig`, or the name of one of
      torchao's recipes: "tensorwise" (the default: one scale per tensor, the
      fastest), "rowwise" (one scale per row: closer to bf16, a little slower)
      or "rowwise_with_gw_hp" (rowwise, with the weight gradients in bf16).
    - `module_filter_func`: `(module, name) -> bool`, the Linear layers that
      become float8. None: those large enough for float8 to pay (see
      `notebook_accel.training.fp8`; a warning names the layers that stay in bf16).
    - `pad_inner_dim`: pad sizes that are not multiples of 16, so that any
      layer can be float8 (None: no padding; only a `module_filter_func` can
      pick such a layer). Used when `config` is a name or None.
    - `enable_fsdp_float8_all_gather`: under FSDP2, gather the sharded weights
      in float8, half the traffic of bf16 (tensorwise only). None: on for
      tensorwise when the model is sharded. Used when `config` is a name or None.

    Unlike Accelerate, a recipe name is accepted for `config`, torchao is not
    imported until a model is prepared (in the worker), and padding is off by
    default (the default layer choice never needs it).
    """

    config: Any = None
    module_filter_func: Callable[[Any, str], bool] | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if importlib.util.find_spec("torchao") is None:
            raise ImportError(
                "AORecipeKwargs configures fp8 training through torchao, which is not installed: "
                "pip install torchao (fp8 also needs a CUDA GPU of compute capability 8.9 or "
                "newer), or leave AORecipeKwargs out and use mixed_precision='bf16'."
            )
        if self.config is None:
            self.config = "tensorwise"
        if isinstance(self.config, str):
            if self.config not in FLOAT8_RECIPES:
                raise ValueError(
                    f"config={self.config!r} is not a float8 recipe; use one of "
                    f"{', '.join(FLOAT8_RECIPES)}, or a torchao.float8.Float8LinearConfig."
                )
            if self.config != "tensorwise" and self.enable_fsdp_float8_all_gather:
                raise ValueError(
                    f"enable_fsdp_float8_all_gather needs the 'tensorwise' recipe; "
                    f"{self.config!r} scales by row. Use config='tensorwise' or leave it off."
                )
        if self.module_filter_func is not None and not callable(self.module_filter_func):
            raise TypeError(
                "module_filter_func must be a function (module, name) -> bool, "
                f"not {type(self.module_filter_func).__name__}."
            )

    @property
    def recipe_name(self) -> str | None:
        """The recipe's name when `config` names one, else None (a config object)."""
        return self.config if isinstance(self.config, str) else None

    def float8_config(self, sharded: bool = False) -> Any:
        """The `Float8LinearConfig` to convert with (imports torchao).

        `sharded`: the model is sharded with FSDP2, where tensorwise weights
        are gathered in float8 unless `enable_fsdp_float8_all_gather=False`.
        """
        if self.recipe_name is None:
            return self.config
        from torchao.float8 import Float8LinearConfig

        pad = bool(self.pad_inner_dim)
        if self.recipe_name == "tensorwise":  # torchao's defaults are the tensorwise recipe
            all_gather = self.enable_fsdp_float8_all_gather
            if all_gather is None:
                all_gather = sharded
            return Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, pad_inner_dim=pad)
        config = Float8LinearConfig.from_recipe_name(self.recipe_name)
        if pad:
            import dataclasses

            config = dataclasses.replace(config, pad_inner_dim=True)
        return config


@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` shards DataLoaders across processes.

    - `split_batches`: each batch of the original loader is split across the
      processes (its batch size must be a multiple of the process count),
      instead of each process reading whole batches of its own.
    - `even_batches`: when the data does not divide evenly, samples from the
      start of the dataset complete the last batches so every process gets the
      same number of equal batches. `gather_for_metrics` drops them again.
    - `use_seedable_sampler`: a shuffling loader draws its order from
      `data_seed + epoch` (seed defaults to torch's initial seed), which makes
      the order reproducible and identical on every process.
    - `non_blocking`: copy batches to the device with `non_blocking=True`.
      None (the default): the device decides; on CUDA batches are pinned and
      copied without blocking, the next one on a side stream while the current
      one trains (a DataLoader already pinned is not pinned again). False:
      blocking copies.
    - `dispatch_batches`: accepted; each process reads its own batches, the ones
      Accelerate's main process would send it (same data, no broadcast).
    - `use_stateful_dataloader`: prepared loaders are torchdata
      `StatefulDataLoader`s too, as in Accelerate: their `state_dict` is
      torchdata's (datasets and samplers with a `state_dict` of their own resume
      without reading the skipped data; worker processes resume too), saved by
      `save_state`. Needs `pip install torchdata`. Without it, prepared loaders
      still save and restore their position (`state_dict`/`load_state_dict`).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool | None = None
    use_stateful_dataloader: bool = False

    # dispatch_batches=True is accepted: every process reads its own batches, which
    # are the ones the main process would have sent it (a warning says so once).


@dataclass
class GradientAccumulationPlugin:
    """How `Accelerator.accumulate` accumulates gradients (Accelerate's plugin).

    - `num_steps`: optimizer steps every this many `accumulate()` blocks.
    - `sync_with_dataloader`: the last batch of a prepared DataLoader always
      ends an accumulation cycle (the optimizer steps there).
    - `sync_each_batch`: all-reduce gradients at every batch anyway (less
      memory on the device, more communication); the optimizer still steps
      every `num_steps`.
    - `adjust_scheduler`: schedulers advance only with real optimizer steps
      (always so here; accepted for compatibility).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (
            isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int)
        ):
            raise ValueError(f"num_steps={self.num_steps!r} must be a whole number.")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be 1 or more.")

    def to_kwargs(self) -> dict[str, Any]:
        """The fields as a dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ProjectConfiguration:
    """Where a project keeps its files (checkpoints and logs live under `project_dir`).

    `save_on_each_node=True` writes the files every process needs (weights,
    optimizer, scheduler, ...) into every directory a checkpoint is saved
    into, not only the main process's: for machines that each save to a disk
    of their own (see `notebook_accel.checkpoint.training_state`).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set `project_dir`, and `logging_dir` too where it is unset."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


CP_COMM_STRATEGIES = ("allgather", "alltoall")


@dataclass
class TorchContextParallelConfig:
    """How torch's context parallelism passes keys and values between the ranks of a "cp"
    group (Accelerate's class): `ParallelismConfig(cp_size=C, cp_handler=...)`; with
    `cp_size` > 1 and no handler, ParallelismConfig makes one with the defaults.

    Args:
        cp_comm_strategy: "allgather" (each rank gathers the others' keys and values after
            its first partial attention) or "alltoall" (the parts are passed round the ring
            by all-to-all). Default `$PARALLELISM_CONFIG_CP_COMM_STRATEGY`, else "allgather".
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        from notebook_accel.config import accelerate_env

        given = "cp_comm_strategy"
        if self.cp_comm_strategy is None:
            given = "$PARALLELISM_CONFIG_CP_COMM_STRATEGY"
            strategy = accelerate_env.parallelism_setting("cp_comm_strategy")
            self.cp_comm_strategy = strategy or "allgather"
        if self.cp_comm_strategy not in CP_COMM_STRATEGIES:
            raise ValueError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy} (from {given}): torch's "
                "context parallelism passes keys and values by 'allgather' or 'alltoall'; "
                "use one of them."
            )


WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
_POLICY_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")


@dataclass
class FullyShardedDataParallelPlugin:
    """Shard the model across the processes with PyTorch's `fully_shard` (FSDP2).

    Pass it as `Accelerator(fsdp_plugin=...)`, or as a launch's `fsdp=` option
    (a dict of these fields, also the `fsdp:` section of a launch YAML file).
    `prepare` then shards every submodule the wrap policy picks, then the model
    itself, instead of wrapping it in DDP. With one process nothing is sharded.

    - `auto_wrap_policy`: which submodules become their own shard group (one
      all-gather each): "transformer_based_wrap" (modules whose class name is in
      `transformer_cls_names_to_wrap`, else in the model's `_no_split_modules`),
      "size_based_wrap" (modules holding at least `min_num_params` parameters
      not already in a smaller group), "no_wrap" (only the whole model), or a
      function `module -> bool`. Default: from whichever of the two lists is set.
    - `reshard_after_forward`: free the gathered parameters after forward and
      gather again in backward (less memory, more communication).
    - `cpu_offload`: keep parameters, gradients and optimizer state on the CPU.
    - `mixed_precision_policy`: None takes the Accelerator's precision (bf16 or
      fp16 compute, float32 gradient reduction); or a dict of `param_dtype`,
      `reduce_dtype`, `output_dtype` ("bf16", "fp16", "fp32"), or a
      `torch.distributed.fsdp.MixedPrecisionPolicy`.
    - `state_dict_type`: accepted as in Accelerate ("SHARDED_STATE_DICT" or
      "FULL_STATE_DICT"), but `save_state` always writes each process's shards
      through `torch.distributed.checkpoint` (they load on any number of
      processes); the whole weights, gathered on the main process, come from
      `save_model` or `get_state_dict`.
    - `fsdp_version`: 2 (the only one; FSDP1 is not supported).
    """

    auto_wrap_policy: Any = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    mixed_precision_policy: Any = None
    state_dict_type: str = "SHARDED_STATE_DICT"
    fsdp_version: int = 2

    def __post_init__(self) -> None:
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version!r}: only FSDP2 (torch's fully_shard) is "
                "supported; use fsdp_version=2."
            )
        self._check_wrapping()
        for name in ("reshard_after_forward", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")
        self.state_dict_type = _state_dict_type(self.state_dict_type)
        if isinstance(self.mixed_precision_policy, dict):
            _check_policy_dict(self.mixed_precision_policy)

    def _check_wrapping(self) -> None:
        """Check the wrap fields and fill in the policy they imply."""
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                name.strip() for name in self.transformer_cls_names_to_wrap.split(",")
            ]
        names = self.transformer_cls_names_to_wrap
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(
                f"transformer_cls_names_to_wrap={names!r} must be a list of module class names."
            )
        size = self.min_num_params
        if size is not None and not (isinstance(size, int) and not isinstance(size, bool)):
            raise ValueError(f"min_num_params={size!r} must be a whole number of parameters.")
        if size is not None and size < 1:
            raise ValueError(f"min_num_params={size!r} must be at least 1.")
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = (
                "transformer_based_wrap" if names else "size_based_wrap" if size else "no_wrap"
            )
        policy = self.auto_wrap_policy
        if not callable(policy) and policy not in WRAP_POLICIES:
            raise ValueError(
                f"auto_wrap_policy={policy!r} must be one of {', '.join(WRAP_POLICIES)} "
                "or a function module -> bool."
            )
        if policy == "size_based_wrap" and not size:
            raise ValueError("auto_wrap_policy='size_based_wrap' needs min_num_params.")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (for YAML and the launch environment).

        Raises ValueError when a field holds a function or a torch object, which
        only `Accelerator(fsdp_plugin=...)` inside the training function can take.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        policy = values["mixed_precision_policy"]
        if callable(values["auto_wrap_policy"]) or not (
            policy is None
            or isinstance(policy, dict)
            and all(isinstance(v, str) for v in policy.values())
        ):
            raise ValueError(
                "this FullyShardedDataParallelPlugin holds a function or a torch object, "
                "which cannot be handed to the workers; create it inside the training "
                "function and pass it as Accelerator(fsdp_plugin=...)."
            )
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FullyShardedDataParallelPlugin:
        """Build from `to_dict()`'s output (or a YAML `fsdp:` section); unknown keys raise."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown FSDP option {unknown[0]!r}; the options are {', '.join(sorted(known))}."
            )
        return cls(**values)


def _state_dict_type(value: Any) -> str:
    kind = str(value).upper()
    if kind in ("SHARDED", "FULL"):
        kind += "_STATE_DICT"
    if kind not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={value!r} must be one of {', '.join(STATE_DICT_TYPES)}.")
    return kind


def _check_policy_dict(policy: dict) -> None:
    for key, value in policy.items():
        if key not in _POLICY_KEYS:
            raise ValueError(
                f"mixed_precision_policy has an unknown key {key!r}; "
                f"it takes {', '.join(_POLICY_KEYS)}."
            )
        if isinstance(value, str) and value.lower() not in DTYPE_NAMES:
            raise ValueError(
                f"mixed_precision_policy {key}={value!r} must be one of {', '.join(DTYPE_NAMES)}."
            )


@dataclass
class TorchDynamoPlugin:
    """How `prepare` compiles models with `torch.compile` (backend "no": not at all).

    `backend` is any `torch.compile` backend name ("inductor" needs a C++ compiler on
    CPU; "aot_eager" traces without generating code). `mode`, `fullgraph` and `dynamic`
    are `torch.compile`'s arguments. Fields left None take Accelerate's
    `ACCELERATE_DYNAMO_BACKEND`, `_MODE`, `_USE_FULLGRAPH` and `_USE_DYNAMIC` variables
    (what `accelerate launch --dynamo_backend ...` sets), else the defaults: no
    compiling, torch's default mode, no full graph.
    """

    backend: str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        from notebook_accel.config import accelerate_env

        for name, value in accelerate_env.dynamo_settings().items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        backend = "no" if self.backend is None else self.backend
        self.backend = str(getattr(backend, "value", backend)).lower()
        self.fullgraph = bool(self.fullgraph)

    @property
    def enabled(self) -> bool:
        """True when a compile backend is chosen."""
        return self.backend != "no"

    def to_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for `torch.compile`: the backend, and what differs from
        torch's defaults (as Accelerate's `to_kwargs` gives them)."""
        kwargs: dict[str, Any] = {"backend": self.backend}
        if self.mode not in (None, "default"):
            kwargs["mode"] = self.mode
        if self.fullgraph:
            kwargs["fullgraph"] = True
        if self.dynamic is not None:
            kwargs["dynamic"] = self.dynamic
        return kwargs
