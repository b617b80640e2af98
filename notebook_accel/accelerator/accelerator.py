"""The `Accelerator`: one object a training function talks to, with Accelerate's API.

It is a thin facade. Who this process is lives in training/state.py, mixed
precision in training/precision.py, sharding in training/data.py, step
bookkeeping in training/optimizers.py, collectives in training/ops.py,
checkpoints in checkpoint/; the methods here only connect them. What only some
runs use (checkpoints, profiling, peft adapters) is imported on first use, so
that a worker's first `Accelerator()` imports only what it needs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from notebook_accel.accelerator import comm_hooks
from notebook_accel.accelerator.tracking import Trackers
from notebook_accel.config import accelerate_env
from notebook_accel.config.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from notebook_accel.config.settings import LaunchSettings
from notebook_accel.platforms import os_kernel
from notebook_accel.reporting.destination import milestone
from notebook_accel.training import compile as compiling
from notebook_accel.training import (
    ddp_teardown,
    device_maps,
    fp8,
    fsdp,
    interrupts,
    ops,
    parallelism,
    tensor_parallel,
)
from notebook_accel.training.data import prepare_data_loader, skip_first_batches
from notebook_accel.training.loader import DataLoaderShard
from notebook_accel.training.nested import apply_to_tensors
from notebook_accel.training.optimizers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    GradientState,
)
from notebook_accel.training.parallelism import ParallelismConfig
from notebook_accel.training.precision import Precision, restore_forward
from notebook_accel.training.registry import TrainingObjects
from notebook_accel.training.state import AcceleratorState, DistributedType

if TYPE_CHECKING:
    from notebook_accel.checkpoint.training_state import CheckpointContext


class Accelerator:
    """Runs a training loop on one process or many with the same code.

    Created inside a worker started by `notebook_launcher` (or `torchrun`) it
    joins the other processes; the launch's `mixed_precision` and
    `gradient_accumulation_steps` apply unless given here. Created anywhere
    else it is a single-process accelerator on the machine's GPU, else its TPU
    (as Accelerate's: once a model goes there the kernel holds the TPU, and a
    later launch needs a restart), else the CPU.

    Args:
        mixed_precision: "no", "fp16", "bf16" or "fp8" (None: the launch's, else "no").
        gradient_accumulation_steps: optimizer steps happen every this many
            `accumulate()` blocks (None: the launch's, else 1).
        cpu: train on the CPU even when a GPU or TPU is present.
        dataloader_config: how DataLoaders are sharded.
        kwargs_handlers: AutocastKwargs, GradScalerKwargs, AORecipeKwargs (fp8),
            DistributedDataParallelKwargs (with a communication hook),
            InitProcessGroupKwargs and ProfileKwargs objects.
        step_scheduler_with_optimizer: schedulers advance only with real optimizer steps.
        project_dir: where the project's files go (checkpoints, logs).
        project_config: a `ProjectConfiguration`: the project's directory and how its
            checkpoints are named and kept.
        device_placement: move models and batches to the device.
        fsdp_plugin: shard models with FSDP2 instead of wrapping them in DDP
            (None: the launch's `fsdp` settings, else DDP).
        dynamo_backend: `torch.compile` models in `prepare` with this backend
            ("inductor", "aot_eager", ...).
        dynamo_plugin: `torch.compile` models in `prepare` with these settings.
        compile: `torch.compile` models in `prepare` with the default backend.
        gradient_accumulation_plugin: the accumulation steps and how they sync
            (instead of `gradient_accumulation_steps`).
        log_with: experiment trackers for `log` (besides the notebook's live view):
            "all" (every installed one), names ("tensorboard", "wandb", "mlflow",
            ...), `GeneralTracker` objects, or a list of them. See `init_trackers`.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        kwargs_handlers: list[KwargsHandler] | None = None,
        step_scheduler_with_optimizer: bool = True,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        rng_types: list[str] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        compile: bool = False,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        log_with: Any = None,
        parallelism_config: ParallelismConfig | None = None,
    ) -> None:
        launch = LaunchSettings.from_env()
        handlers = _sort_handlers(kwargs_handlers or [])
        self.state = AcceleratorState(
            cpu, init_process_group_kwargs=handlers.get(InitProcessGroupKwargs)
        )
        self.parallelism_config = parallelism_config
        if parallelism_config is not None:
            parallelism_config.check_world(self.state.num_processes)
            fsdp_plugin = _plugin_for_parallelism(parallelism_config, fsdp_plugin)
        # Precedence: the argument, the launch's settings, Accelerate's variables, the default.
        if mixed_precision is None:
            mixed_precision = (
                launch.mixed_precision if launch else accelerate_env.mixed_precision() or "no"
            )
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin()
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps is not None:
            raise ValueError(
                "pass gradient_accumulation_steps or gradient_accumulation_plugin, not both."
            )
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = plugin.num_steps
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = (
                launch.gradient_accumulation_steps
                if launch
                else accelerate_env.gradient_accumulation_steps() or 1
            )
        if int(gradient_accumulation_steps) < 1:
            raise ValueError(
                f"gradient_accumulation_steps={gradient_accumulation_steps}; it must be 1 or more."
            )
        self.precision = Precision(
            mixed_precision,
            self.state.platform,
            self.state.device,
            handlers.get(AutocastKwargs),
            handlers.get(GradScalerKwargs),
            handlers.get(AORecipeKwargs),
            main_process=self.state.is_main_process,
        )
        self.state.mixed_precision = self.precision.name
        self.ddp_kwargs = handlers.get(DistributedDataParallelKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)
        if self.ddp_kwargs is not None:
            comm_hooks.check(self.ddp_kwargs, self.state.backend)
        self.fsdp_plugin = fsdp.plugin_for(fsdp_plugin, launch)
        self.state.use_fsdp_plugin(self.fsdp_plugin)
        self.dynamo_plugin = compiling.plugin_for(
            dynamo_backend, dynamo_plugin, compile, self.state.platform.compile_problem
        )
        self._shards = fsdp.ShardMap()  # to re-point optimizers at sharded parameters
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not None:  # the older spelling, still accepted by Accelerate
            self.dataloader_config.split_batches = split_batches
        if self.dataloader_config.use_stateful_dataloader:  # say now that torchdata is missing
            from notebook_accel.training.stateful_data import stateful_data_loader

            stateful_data_loader()
        self.gradient_state = GradientState(
            num_steps=int(gradient_accumulation_steps),
            sync_with_dataloader=plugin.sync_with_dataloader,
            adjust_scheduler=plugin.adjust_scheduler,
            sync_each_batch=plugin.sync_each_batch,
        )
        # The state is shared (Accelerate's GradientState); a new Accelerator starts with no
        # accumulation in progress, whatever a loop stopped half way left there.
        self.gradient_state.sync_gradients = True
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None and self.project_configuration.project_dir is None:
            # As in Accelerate: the argument fills a configuration that names no directory.
            self.project_configuration.set_directories(project_dir)
        if rng_types is not None:
            # Accelerate synchronises these generators at every epoch; here the
            # seedable sampler (use_seedable_sampler) keeps shuffles in step instead.
            warnings.warn(
                "rng_types is accepted for compatibility and not used: DataLoader shuffles "
                "stay in step across processes through the seedable sampler.",
                stacklevel=2,
            )
        self.rng_types = rng_types
        # Checked now, so a tracker name or package that is wrong fails before training.
        self._trackers = Trackers(log_with, self.logging_dir)
        self.flag_tensor: torch.Tensor | None = None
        # Everything prepared or registered, in order: what checkpoints save.
        self._objects = TrainingObjects(scaler=self.precision.scaler)
        self._save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._warned_no_context_parallel = False  # maybe_context_parallel warns once
        os_kernel.check_once()

    # -- who and where ------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The torch device this process trains on."""
        return self.state.device

    @property
    def torch_device_mesh(self) -> Any:
        """The `DeviceMesh` of the `parallelism_config` (None without one): its enabled
        dimensions, and Accelerate's flattened "dp", "dp_shard_cp" and "dp_cp"."""
        config = self.parallelism_config
        return config.get_device_mesh(self.device.type) if config is not None else None

    @property
    def num_processes(self) -> int:
        """How many processes train together (the world size)."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """This process's rank among all processes, from 0."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """This process's rank on this machine, from 0."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """True on the process with rank 0 (the one that writes shared files)."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of this machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """True on the process with the highest rank."""
        return self.state.is_last_process

    @property
    def distributed_type(self) -> DistributedType:
        """How the processes cooperate: NO, MULTI_CPU, MULTI_GPU, XLA, or FSDP while an FSDP
        plugin shards the models."""
        return self.state.distributed_type

    @property
    def use_distributed(self) -> bool:
        """True when more than one process trains."""
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        """The precision in use: "no", "fp16", "bf16" or "fp8"."""
        return self.precision.name

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler, or None outside fp16."""
        return self.precision.scaler

    @property
    def split_batches(self) -> bool:
        """Whether each batch is split across processes (else each gets whole batches)."""
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        """Whether every process gets the same number of batches (by repeating samples)."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """Whether shuffling goes through the seedable, epoch-aware sampler."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def project_dir(self) -> str | None:
        """Where checkpoints and logs go (from ProjectConfiguration), or None."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where logs go (from ProjectConfiguration), or None."""
        return self.project_configuration.logging_dir

    @property
    def sync_gradients(self) -> bool:
        """True on steps where gradients are all-reduced and the optimizer steps."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step under accumulate()."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._objects.optimizers)

    @property
    def step(self) -> int:
        """The gradient-accumulation counter: `accumulate()` blocks since a DataLoader pass
        ended. Saved and restored by checkpoints."""
        return self._objects.step

    @step.setter
    def step(self, value: int) -> None:
        self._objects.step = value

    # -- prepare -------------------------------------------------------------------

    def prepare(
        self,
        *args: Any,
        device_placement: list[bool] | None = None,
        tp_plan: Mapping[str, Any] | None = None,
    ) -> Any:
        """Ready models, optimizers, schedulers and DataLoaders for this run.

        Returns them in the order given (a single object when one is given).
        Schedulers are prepared last, so they see the wrapped optimizers.
        With a `parallelism_config` whose `tp_size` > 1, `tp_plan` says how to split
        the model over the "tp" dimension (see `prepare_model`).
        """
        placement = device_placement or [self.device_placement] * len(args)
        if len(placement) != len(args):
            raise ValueError("device_placement needs one entry per object passed to prepare().")
        if tp_plan is not None and sum(isinstance(o, torch.nn.Module) for o in args) != 1:
            raise ValueError(
                "tp_plan= splits one model: pass prepare() exactly one, or call "
                "prepare_model(model, tp_plan=...) for each."
            )
        result = list(args)
        for i, obj in enumerate(args):
            if not _is_scheduler(obj):
                result[i] = self._prepare_one(obj, placement[i], tp_plan)
        for optimizer in self._objects.optimizers:  # prepared before their model was sharded
            fsdp.switch_optimizer_parameters(optimizer, self._shards)
        if self.fsdp_plugin is not None and self.mixed_precision == "fp8":
            fp8.refresh_scales_after_steps(self._objects.models, self._objects.optimizers)
        for i, obj in enumerate(args):
            if _is_scheduler(obj):
                result[i] = self.prepare_scheduler(obj)
        for obj in result:
            if _is_prepared_object(obj):
                _mark_prepared(obj)
        milestone()  # a launched worker reports what it imported (launch/warm.py)
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, device_placement: bool, tp_plan: Any = None) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=device_placement, tp_plan=tp_plan)
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
            return self.prepare_optimizer(obj)
        if isinstance(obj, DataLoader) and not isinstance(obj, DataLoaderShard):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        return obj

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
        tp_plan: Mapping[str, Any] | None = None,
    ) -> torch.nn.Module:
        """Move `model` to the device, apply mixed precision, wrap it for distribution, compile.

        When distributed, the model is wrapped in DDP, or with an FSDP plugin
        sharded in place (the same object, its parameters now DTensor shards).
        With a dynamo backend the result is `torch.compile`d.

        With a `parallelism_config` whose `tp_size` > 1, a model not split already is
        split over the "tp" dimension by torch's `parallelize_module`: by `tp_plan`
        (module names, `*` for any one name, to torch's styles such as
        `ColwiseParallel()`, or transformers' names such as "colwise"), or by the
        model's own plan (a transformers model's `tp_plan`).
        """
        if any(model is prepared for prepared in self._objects.models):
            return model  # prepared already: wrapping it again would nest DDP
        config = self.parallelism_config
        split_by = None  # checked before anything is done to the model
        if config is not None and config.tp_enabled:
            split_by = tensor_parallel.plan_for(model, config.tp_size, tp_plan)
        elif tp_plan is not None:
            raise ValueError(
                "tp_plan= splits a model over the tp dimension, but there is none: "
                "Accelerator(parallelism_config=ParallelismConfig(tp_size=...))."
            )
        self._objects.models.append(model)
        if device_maps.is_quantized(model):
            device_maps.check_quantized_placement(model, self.device, self.use_distributed)
        placed_by_map = device_maps.is_quantized(model) and hasattr(model, "hf_device_map")
        placed_by_map = placed_by_map or device_maps.spread_by_device_map(model)
        if not placed_by_map and (
            device_placement if device_placement is not None else self.device_placement
        ):
            before = dict(model.named_parameters())
            model = model.to(self.device)
            # Moved to an XLA device, parameters are new objects; optimizers made
            # with the old ones are re-pointed when prepared, as for FSDP shards.
            for name, parameter in model.named_parameters():
                if name in before and before[name] is not parameter:
                    self._shards.add(before[name], parameter)
        if split_by is not None:
            mesh = self.torch_device_mesh["tp"]
            self._shards.update(tensor_parallel.split_model(model, mesh, split_by))
        trainable = any(p.requires_grad for p in model.parameters())
        shards = self.use_distributed and trainable and not evaluation_mode
        model = self.precision.prepare_model(
            model,
            sharded=shards and self.fsdp_plugin is not None,
            compiled=self.dynamo_plugin is not None,
        )
        if shards:
            model = self._distribute(model)
        if self.dynamo_plugin is not None:
            model = compiling.compile_model(model, self.dynamo_plugin)
        self._objects.models[-1] = model
        return model

    def _distribute(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard `model` in place (FSDP2, over the parallelism config's mesh if any), or
        wrap it in DDP; tensor parallel alone leaves it as it is."""
        config = self.parallelism_config
        if self.fsdp_plugin is not None:
            shards = fsdp.shard_model(
                model,
                self.fsdp_plugin,
                self.precision.name,
                self.device,
                pin_memory=self.state.platform.pins_host_memory,
                mesh=config.fsdp_mesh(self.device.type) if config is not None else None,
            )
            self._shards.update(shards)
        elif config is not None and config.tp_enabled:
            pass  # its DTensors already make every rank's gradients whole
        elif self.state.platform.wraps_model_in_ddp:  # XLA averages at the step
            kwargs = self.state.platform.ddp_kwargs(self.device)
            kwargs.update(self.ddp_kwargs.to_kwargs() if self.ddp_kwargs else {})
            model = DistributedDataParallel(model, **kwargs)
            ddp_teardown.free_group_after_reducer(model)
            if self.ddp_kwargs is not None:
                comm_hooks.register(model, self.ddp_kwargs)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        """Wrap `optimizer` so it skips accumulation steps and fp16 overflow steps."""
        fsdp.switch_optimizer_parameters(optimizer, self._shards)
        wrapped = AcceleratedOptimizer(
            optimizer, self.gradient_state, self.scaler, platform=self.state.platform
        )
        self._objects.optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap `scheduler` so it advances only when its optimizer really stepped."""
        owner = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self._objects.optimizers if o.optimizer is owner or o is owner]
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers or list(self._objects.optimizers),
            self.gradient_state,
            num_processes=self.num_processes,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._objects.schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoaderShard:
        """Shard `data_loader` for this process (see `DataLoaderConfiguration`)."""
        place = self.device_placement if device_placement is None else device_placement
        config = self.dataloader_config
        # Ranks that share a batch (tensor or context parallel) read the same part.
        parallel = self.parallelism_config
        prepared = prepare_data_loader(
            data_loader,
            dispatch_batches=config.dispatch_batches,
            num_processes=parallel.data_parallel_size if parallel else self.num_processes,
            process_index=(
                parallel.data_parallel_rank(self.process_index) if parallel else self.process_index
            ),
            device=self.device,
            put_on_device=bool(place),
            gradient_state=self.gradient_state,
            split_batches=config.split_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            platform=self.state.platform,
        )
        self._objects.dataloaders.append(prepared)
        return prepared

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = False,
    ) -> torch.nn.Module:
        """The user's model: without `torch.compile`'s, DDP's and DataParallel's wrappers
        (and the precision wrapper if asked).

        `keep_torch_compile=True` gives the unwrapped model compiled as the given one was
        (Accelerate's default); by default the user's own module comes back, whose
        `state_dict()` keys carry no `_orig_mod.` prefix. A model sharded with FSDP is
        the user's own object already (its class swapped for an FSDP subclass, its
        parameters DTensor shards); `get_state_dict` gives its whole weights.
        """
        compiled = compiling.compiled_wrapper(model)
        model = compiling.unwrap_compiled(model)
        while isinstance(model, (DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        if not keep_fp32_wrapper:
            restore_forward(model)
        if keep_torch_compile and compiled is not None:
            return compiling.recompiled_around(compiled, model)
        return model

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's whole weights, as `unwrap_model(model).state_dict()` would give.

        A sharded model's weights are gathered to the CPU of the main process
        (other processes get {}); every process must call this then.
        """
        model = self.unwrap_model(model) if unwrap else model
        inner = compiling.unwrap_compiled(model)
        if fsdp.is_sharded(inner) or fsdp.has_distributed_tensors(inner):  # or split (TP)
            return fsdp.full_state_dict(inner)
        return _offloaded_weights_read_back(model) or model.state_dict()

    # -- the training step -----------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, divided by the accumulation steps and scaled under fp16."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def accumulate(self, *models: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step of gradient accumulation.

        Sets `sync_gradients` (True every `gradient_accumulation_steps` calls and
        on the last batch of a prepared DataLoader); on the other steps the
        optimizers do nothing and `models` skip the gradient all-reduce.
        """
        return _MicroStep(self, models)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) inside the block.

        A no-op in one process.
        """
        model = compiling.unwrap_compiled(model)
        if isinstance(model, DistributedDataParallel):
            context = model.no_sync()
        elif fsdp.is_sharded(model):
            context = fsdp.no_gradient_sync(model)
        else:
            context = contextlib.nullcontext()
        with context:
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Make the next backward all-reduce gradients although the forward ran under `no_sync`.

        For the pattern: several forwards under `no_sync`, then the backwards,
        syncing at the last one. A no-op in one process and for unwrapped models.
        """
        model = compiling.unwrap_compiled(model)
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        before = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        # The forward under no_sync left the reducer unprepared: prepare it now.
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: list, even_batches: bool | None = None
    ) -> Iterator[None]:
        """Let processes with fewer batches finish while the others still train (DDP).

        Inside the block DDP models shadow the collectives of processes that ran
        out of batches (`torch.distributed.algorithms.Join`). `even_batches`
        overrides the prepared map-style loaders' setting for the block (so they
        can really be uneven). Outside DDP training it warns and does nothing.
        """
        if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            warnings.warn(
                "join_uneven_inputs is only supported for multi-GPU and multi-CPU DDP "
                f"training; with {self.distributed_type} it does nothing.",
                UserWarning,
                stacklevel=3,
            )
            yield
            return
        from torch.distributed.algorithms import Join

        with contextlib.ExitStack() as stack:
            if even_batches is not None:
                stack.enter_context(self._override_even_batches(even_batches))
            stack.enter_context(Join(joinables))
            yield

    @contextlib.contextmanager
    def _override_even_batches(self, even_batches: bool) -> Iterator[None]:
        samplers = [
            loader.batch_sampler
            for loader in self._objects.dataloaders
            if hasattr(getattr(loader, "batch_sampler", None), "even_batches")
        ]
        if len(samplers) < len(self._objects.dataloaders):
            warnings.warn(
                "join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                "loaders over iterable datasets keep their setting.",
                UserWarning,
                stacklevel=4,
            )
        saved = [sampler.even_batches for sampler in samplers]
        for sampler in samplers:
            sampler.even_batches = even_batches
        try:
            yield
        finally:
            for sampler, value in zip(samplers, saved, strict=True):
                sampler.even_batches = value

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Split `buffers` (inputs, labels, position ids) along their sequence dimensions
        `buffer_seq_dims` among the context-parallel ranks while the block runs, SDPA
        attention exchanging what it needs (torch's context parallelism, on CUDA) as the
        config's `cp_handler.cp_comm_strategy` says; the buffers are whole again
        afterwards, except `no_restore_buffers`. Make one per step. Without `cp_size` > 1
        in the parallelism config it does nothing (with one warning), so the same loop
        runs either way."""
        config = self.parallelism_config
        if config is None or not config.cp_enabled:
            if not self._warned_no_context_parallel:
                self._warned_no_context_parallel = True
                warnings.warn(
                    "maybe_context_parallel() does nothing: set cp_size > 1 in the "
                    "ParallelismConfig to split sequences.",
                    stacklevel=2,
                )
            return contextlib.nullcontext()
        mesh = self.torch_device_mesh["cp"]
        strategy = config.cp_handler.cp_comm_strategy
        return parallelism.split_sequences(
            mesh, buffers, buffer_seq_dims, no_restore_buffers, cp_comm_strategy=strategy
        )

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """Run the block in the configured mixed precision (no-op in full precision)."""
        with self.precision.autocast(autocast_handler):
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16-scaled gradients by the loss scale (no-op otherwise).

        Only on steps that will update: unscaling an accumulation step would mix
        unscaled and scaled gradients. Where no DDP wrapper averaged the
        gradients over the processes (XLA), they are averaged here first.
        """
        if not self.sync_gradients:
            return
        for opt in self._objects.optimizers:
            opt.reduce_gradients()
        if self.scaler is None:
            return
        targets = self._objects.optimizers if optimizer is None else optimizer
        for opt in targets if isinstance(targets, (list, tuple)) else [targets]:
            if not isinstance(opt, AcceleratedOptimizer):
                self.scaler.unscale_(opt)
            elif not opt.gradients_unscaled:  # clipping twice in a step must not unscale twice
                self.scaler.unscale_(opt.optimizer)
                opt.gradients_unscaled = True

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` on true (unscaled) gradients; returns the total norm.

        With FSDP the norm covers every process's shards (a plain tensor, not a DTensor).
        """
        parameters = list(parameters)
        if self._scaled_partial_gradients():
            grads = [p.grad for p in parameters if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, norm_type) / self.scaler.get_scale()
            return fsdp.full_tensor(norm)
        self.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return fsdp.full_tensor(norm)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """`torch.nn.utils.clip_grad_value_` on true (unscaled) gradients."""
        if self._scaled_partial_gradients():
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def _scaled_partial_gradients(self) -> bool:
        """True on an fp16 accumulation step, where clipping would corrupt the sum.

        The gradients there are still multiplied by the loss scale and only part
        of the step's sum; Accelerate raises on the second unscale. Here the
        clip is skipped (warned once): clip when `sync_gradients` is True.
        """
        if self.scaler is None or self.sync_gradients:
            return False
        if not getattr(self, "_warned_partial_clip", False):
            self._warned_partial_clip = True
            warnings.warn(
                "clipping on a gradient-accumulation step under fp16 is skipped: the gradients "
                "are scaled and only part of the step's sum. Clip when "
                "accelerator.sync_gradients is True.",
                stacklevel=3,
            )
        return True

    # -- collectives -------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (nested) from all processes along dim 0."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: exactly one result per dataset sample.

        On the last batch of a prepared DataLoader, the samples that
        `even_batches` repeated to fill the last batches are dropped. Data that
        is not made of tensors is gathered as objects.
        """
        if not use_gather_object:
            try:
                apply_to_tensors(lambda t: t, input_data, strict="gather")
            except TypeError:
                use_gather_object = True
        config = self.parallelism_config
        if config is not None and config.non_data_parallel_size > 1:
            data = self._gather_data_parallel(input_data, use_gather_object, config)
        elif use_gather_object:
            data = ops.gather_object(input_data)
        else:
            data = ops.gather(input_data)
        remainder = self.gradient_state.remainder
        if not self.gradient_state.end_of_dataloader or remainder <= 0:
            return data
        if use_gather_object:
            return data[:remainder]
        return apply_to_tensors(lambda t: t[:remainder], data)

    @staticmethod
    def _gather_data_parallel(data: Any, as_objects: bool, config: ParallelismConfig) -> Any:
        """`gather_for_metrics`' gather where ranks share batches (tensor parallel): each
        batch's results once, from the first rank of its group."""
        world = ops.world_size()
        if as_objects:
            per_rank: list[Any] = [None] * world
            torch.distributed.all_gather_object(per_rank, data)
            kept = parallelism.first_of_each_data_parallel_rank(per_rank, config)
            if all(isinstance(item, (list, tuple)) for item in kept):
                return [x for item in kept for x in item]
            return kept

        def first_of_each_group(tensor: torch.Tensor) -> torch.Tensor:
            # rank order along dim 0, each rank's part the same size
            per_rank = tensor.reshape(world, -1, *tensor.shape[1:])
            kept = parallelism.first_of_each_data_parallel_rank(per_rank, config)
            return kept.reshape(-1, *tensor.shape[1:])

        return apply_to_tensors(first_of_each_group, ops.gather(data))

    def gather_object(self, obj: Any) -> list:
        """Gather picklable objects from all processes into one list (lists are concatenated)."""
        return ops.gather_object(obj)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (or "mean", "max") tensors (nested) across processes."""
        return ops.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors (nested) along `dim` to the largest size on any process."""
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Give every process `from_process`'s values of the tensors (nested), in place."""
        return ops.broadcast(tensor, from_process)

    def set_trigger(self) -> None:
        """Raise a flag on this process; `check_trigger` sees it on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger` (resets the flag). A collective.

        On live workers a stop press counts as a trigger too, so a loop that
        checks each step stops at the same step on every worker.
        """
        if interrupts.requested():
            self.set_trigger()
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        if int(self.reduce(self.flag_tensor).item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            interrupts.clear()
            return True
        return False

    # -- coordination -----------------------------------------------------------------

    # The process-level helpers are the state's (Accelerate's PartialState API);
    # the Accelerator hands them on.

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this line."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        self.state.print(*args, **kwargs)

    def log(
        self,
        values: dict,
        step: int | None = None,
        log_kwargs: dict | None = None,
        main_process_only: bool = True,
    ) -> None:
        """Send metrics to the trackers and to the notebook (live view, loss curve, `last_run()`).

        As in Accelerate, only the main process logs unless `main_process_only=False`
        (then every rank's values reach the notebook, tagged with their rank; the
        trackers still get the main process's only). The notebook shows numbers,
        one-element tensors and strings; other values (a dict of scalars for
        TensorBoard, say) go to the trackers only. `log_kwargs`: tracker name ->
        keyword arguments for that tracker's `log`.
        """
        from notebook_accel.reporting import metrics

        if main_process_only and not self.is_main_process:
            return
        if self.is_main_process:
            self._trackers.log(values, step, log_kwargs)
        if self._trackers.log_with:
            values = {k: v for k, v in values.items() if metrics.is_shown(v)}
        metrics.record(values, step=step)

    # -- experiment tracking (main process only, as in Accelerate) -------------------

    @property
    def log_with(self) -> list:
        """The trackers asked for (names, and GeneralTracker objects)."""
        return self._trackers.log_with

    @property
    def trackers(self) -> list:
        """The started trackers (on the main process; empty elsewhere)."""
        return self._trackers.started

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start a run of every tracker in `log_with` for `project_name` (main process only).

        `config`: the run's hyperparameters, stored by each tracker.
        `init_kwargs`: tracker name -> keyword arguments for that tracker's run,
        e.g. `{"wandb": {"tags": ["a"]}, "tensorboard": {"flush_secs": 60}}`.
        """
        if self.is_main_process:
            self._trackers.init(project_name, config, init_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (its library's own run object with `unwrap`).

        On other processes, where nothing is started, a tracker that does nothing.
        """
        return self._trackers.get(name, unwrap)

    def end_training(self) -> None:
        """Finish every tracker's run and wait for every process.

        In a plain script (`notebook-accel launch`, torchrun) it also leaves the
        process group, as Accelerate does; under `notebook_launcher` and live
        workers the launcher leaves it when the function returns, so the group
        stays usable for whatever the function does next.
        """
        if self.is_main_process:
            self._trackers.finish()
        self.wait_for_everyone()
        if not _launcher_owns_process_group():
            self.state.destroy_process_group()

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with `torch.profiler`; yields the profiler.

        Settings from `profile_handler`, else the `ProfileKwargs` among
        `kwargs_handlers`, else torch's defaults. With `output_trace_dir` each
        process writes `profile_<rank>.json` (a Chrome trace) there at the end.
        """
        from notebook_accel.accelerator import profiling

        settings = profile_handler or self.profile_handler or ProfileKwargs()
        with profiling.profile(settings, self.process_index, self.wait_for_everyone) as prof:
            yield prof

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block first (say, to download), then the others."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process of each machine runs the block first, then the others."""
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process only (None elsewhere)."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on each machine's main process only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the last process only."""
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Any:
        """Decorator: run `function` on process `process_index` only."""
        return self.state.on_process(function, process_index=process_index)

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager:
        """Give each process its contiguous share of a list, tuple, tensor, dataset or dict of them.

        The first `len % num_processes` processes get one item more. With
        `apply_padding=True` the shorter shares repeat the last item so all
        shares have equal length (handy before `gather`).
        """
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    # -- checkpoints --------------------------------------------------------------------

    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True
    ) -> str:
        """Save everything needed to resume this run exactly; returns the directory.

        Saves every prepared model, optimizer and scheduler, the fp16 loss
        scaler, the random generators of every process, the step counter, where
        each prepared DataLoader stands (mid-epoch too), and the objects given to
        `register_for_checkpointing`. Every process must call it. The directory
        appears complete or not at all. With
        `ProjectConfiguration(automatic_checkpoint_naming=True)` it is
        `project_dir/checkpoints/checkpoint_N` and `total_limit` old ones are kept.
        See `notebook_accel.checkpoint.training_state` for the files.
        """
        from notebook_accel.checkpoint import training_state
        from notebook_accel.reporting.destination import checkpoint_saved

        saved = str(
            training_state.save_state(self._checkpoint_context(), output_dir, safe_serialization)
        )
        if self.is_main_process:  # a detached run records where it can resume from
            checkpoint_saved(str(Path(saved).resolve()))
        return saved

    def load_state(self, input_dir: str | os.PathLike | None = None) -> str:
        """Restore what `save_state` saved; returns the directory it loaded.

        Without `input_dir`, loads the newest complete checkpoint of an
        automatically named project. Prepare and register the same objects
        first. Afterwards each prepared DataLoader's next pass continues the
        saved epoch where it stopped. A missing, corrupted or mismatched
        checkpoint raises `CheckpointError` on every process and changes nothing.
        """
        from notebook_accel.checkpoint import training_state

        return str(training_state.load_state(self._checkpoint_context(), input_dir))

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include `objects` (each with `state_dict` and `load_state_dict`) in checkpoints."""
        self._objects.register(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` in every `save_state`, before its files
        are written; returns a handle whose `remove()` unregisters it.

        `models` are the prepared models, `weights` their state dicts (empty when the
        models are sharded), `output_dir` the directory being written: files the hook
        writes there are part of the checkpoint (committed with it, atomically). It runs
        on every process. It may change the tensors in `weights`, not remove entries.
        """
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` in every `load_state`, once the checkpoint has been
        checked and before anything is restored; returns a handle whose `remove()`
        unregisters it. It runs on every process."""
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    @property
    def _models(self) -> list[torch.nn.Module]:
        """The prepared models (Accelerate's attribute, which code reads)."""
        return self._objects.models

    @property
    def _optimizers(self) -> list[AcceleratedOptimizer]:
        """The prepared optimizers."""
        return self._objects.optimizers

    @property
    def _schedulers(self) -> list[AcceleratedScheduler]:
        """The prepared schedulers."""
        return self._objects.schedulers

    @property
    def _dataloaders(self) -> list[DataLoaderShard]:
        """The prepared DataLoaders."""
        return self._objects.dataloaders

    @property
    def _custom_objects(self) -> list[Any]:
        """The objects given to `register_for_checkpointing`."""
        return self._objects.custom_objects

    def _checkpoint_context(self) -> CheckpointContext:
        """What the checkpoint code needs, as of now (accumulation state included)."""
        from notebook_accel.checkpoint.training_state import CheckpointContext

        return CheckpointContext(
            objects=self._objects,
            project=self.project_configuration,
            process_index=self.process_index,
            num_processes=self.num_processes,
            barrier=self.wait_for_everyone,
            unwrap=self.unwrap_model,
            mixed_precision=self.mixed_precision,
            sync_gradients=self.sync_gradients,
            save_hooks=list(self._save_hooks.values()),
            load_hooks=list(self._load_hooks.values()),
        )

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """`dataloader` without its first `num_batches` batches.

        For resuming in the middle of an epoch the way Accelerate does it. With a
        prepared DataLoader the skipped batches of its next pass are not read and
        no random generator moves, so the resumed run matches an uninterrupted
        one. A plain DataLoader gives a DataLoader to prepare (see
        `notebook_accel.skip_first_batches`).
        """
        return skip_first_batches(dataloader, num_batches)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model's weights, sharded, on the main process.

        safetensors by default, with an index file when there are several
        shards; `notebook_accel.load_model_weights` reads them into a plain model.
        A peft `PeftModel` writes its adapter only, in peft's format
        (`adapter_config.json`, `adapter_model.safetensors`), which
        `PeftModel.from_pretrained` loads. Every process must call it.
        """
        from notebook_accel.checkpoint import training_state
        from notebook_accel.training import adapters

        model = self.unwrap_model(model)
        if adapters.is_peft_model(model):
            state = adapters.adapter_state_dict(model)  # gathered from every process
            if self.is_main_process:
                adapters.save_adapter(model, save_directory, state, safe_serialization)
            return
        if fsdp.is_sharded(model):  # every process sends its shards to the main one
            model = fsdp.full_state_dict(model)
        elif self.is_main_process:  # a dispatched model's offloaded weights, read back
            model = _offloaded_weights_read_back(model) or model
        if self.is_main_process:
            training_state.save_model(model, save_directory, max_shard_size, safe_serialization)

    # -- housekeeping -----------------------------------------------------------------

    def free_memory(self, *objects: Any) -> list:
        """Forget what was prepared and free cached device memory; returns Nones for `objects`."""
        self._objects.clear()  # the step counter too
        self._shards = fsdp.ShardMap()  # it holds every sharded parameter
        self.flag_tensor = None
        gc.collect()
        self.state.platform.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    def __repr__(self) -> str:
        return (
            f"Accelerator(process {self.process_index} of {self.num_processes}, "
            f"device={self.device}, "
            f"mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


def _is_prepared_object(obj: Any) -> bool:
    return isinstance(
        obj,
        (torch.nn.Module, AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard),
    )


def _mark_prepared(obj: Any) -> None:
    """Accelerate's `_is_accelerate_prepared` flag, which code checks before preparing."""
    with contextlib.suppress(AttributeError, TypeError):
        obj._is_accelerate_prepared = True


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
    )


def _launcher_owns_process_group() -> bool:
    """Whether notebook_accel's launcher (or live workers) runs this function.

    They install where the function's metrics go, and leave the process group
    themselves when it returns.
    """
    from notebook_accel.reporting.destination import current

    return current().metric is not None


def _sort_handlers(handlers: list[KwargsHandler]) -> dict[type, Any]:
    known = (
        AutocastKwargs,
        GradScalerKwargs,
        AORecipeKwargs,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    found: dict[type, Any] = {}
    for handler in handlers:
        kind = next((k for k in known if isinstance(handler, k)), None)
        if kind is None:
            raise TypeError(
                f"kwargs_handlers got a {type(handler).__name__}; it takes "
                + ", ".join(k.__name__ for k in known)
                + "."
            )
        if kind in found:
            raise ValueError(f"kwargs_handlers has more than one {kind.__name__}; pass one.")
        found[kind] = handler
    return found


def _offloaded_weights_read_back(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The state dict of a model with weights offloaded by dispatch_model or cpu_offload,
    read back from where they are kept; None for any other model (its state dict holds
    its weights). No model is offloaded before the big-model package is imported, so
    saving any other model does not import it."""
    if "notebook_accel.big_modeling.hooks" not in sys.modules:
        return None
    from notebook_accel.big_modeling import hooks

    if not hooks.has_offloaded_weights(model):
        return None
    return hooks.get_state_dict_offloaded_model(model)


def _plugin_for_parallelism(
    config: ParallelismConfig, plugin: FullyShardedDataParallelPlugin | None
) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin a parallelism config shards with: the one given, or FSDP2's defaults
    when `dp_shard_size` > 1."""
    if not config.dp_shard_cp_dim_names:
        if plugin is not None:
            raise ValueError(
                "an FSDP plugin with a ParallelismConfig shards over its dp_shard_size, which "
                "is 1: set dp_shard_size (and dp_replicate_size for HSDP), or leave the plugin "
                "out for DDP."
            )
        return None
    return plugin if plugin is not None else FullyShardedDataParallelPlugin()


class _MicroStep:
    """What `Accelerator.accumulate` returns: a plain class rather than a generator-based
    context manager, since it wraps every training step (bench/step.py)."""

    __slots__ = ("_accelerator", "_models", "_no_sync")

    def __init__(self, accelerator: Accelerator, models: tuple[torch.nn.Module, ...]) -> None:
        self._accelerator = accelerator
        self._models = models
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        accelerator = self._accelerator
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.sync_with_dataloader:
            accelerator.step = 0
            state.sync_gradients = True
        else:
            accelerator.step += 1
            state.sync_gradients = accelerator.step % state.num_steps == 0
        if not (state.sync_gradients or state.sync_each_batch) and self._models:
            with contextlib.ExitStack() as stack:  # left open only once every model is in
                for model in self._models:
                    stack.enter_context(accelerator.no_sync(model))
                self._no_sync = stack.pop_all()

    def __exit__(self, *exc_info: Any) -> bool:
        stack, self._no_sync = self._no_sync, None
        return bool(stack is not None and stack.__exit__(*exc_info))
