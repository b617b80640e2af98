"""notebook_accel: train PyTorch models on every device of the machine from a notebook.

Public names are imported on first use so that `import notebook_accel` stays
fast and does not import torch, ipywidgets or rich until they are needed.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# This file imports none of the package's modules: see _lazy.py for why.

__version__ = "0.1.0"

# torch.cuda.is_available() then asks NVML instead of initialising the CUDA
# driver, so a kernel that checks for GPUs can still fork CUDA workers.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# public name -> module that defines it
_EXPORTS = {
    "notebook_launcher": "notebook_accel.launch.launcher",
    "debug_launcher": "notebook_accel.launch.launcher",
    "last_run": "notebook_accel.launch.launcher",
    "WorkerError": "notebook_accel.launch.errors",
    "PlacementError": "notebook_accel.launch.errors",
    "attach": "notebook_accel.launch.runs.handle",
    "runs": "notebook_accel.launch.runs.handle",
    "resume": "notebook_accel.launch.runs.handle",
    "resume_checkpoint": "notebook_accel.launch.runs.handle",
    "DetachedRun": "notebook_accel.launch.runs.detached",
    "RunLostError": "notebook_accel.launch.runs.detached",
    "release_cluster": "notebook_accel.launch.cluster",
    "LaunchSettings": "notebook_accel.config.settings",
    "LaunchConfig": "notebook_accel.launch.options",
    "detect_hardware": "notebook_accel.platforms",
    "Hardware": "notebook_accel.platforms",
    "start_workers": "notebook_accel.live",
    "LiveWorkers": "notebook_accel.live",
    "panel": "notebook_accel.ui.panel",
    "LaunchPanel": "notebook_accel.ui.panel",
    "Accelerator": "notebook_accel.accelerator.accelerator",
    "PartialState": "notebook_accel.training.state",
    "AcceleratorState": "notebook_accel.training.state",
    "GradientState": "notebook_accel.training.optimizers",
    "GradientAccumulationPlugin": "notebook_accel.config.kwargs",
    "ParallelismConfig": "notebook_accel.training.parallelism",
    "prepare_data_loader": "notebook_accel.training.data",
    "skip_first_batches": "notebook_accel.training.data",
    "AORecipeKwargs": "notebook_accel.config.kwargs",
    "AutocastKwargs": "notebook_accel.config.kwargs",
    "DataLoaderConfiguration": "notebook_accel.config.kwargs",
    "DistributedDataParallelKwargs": "notebook_accel.config.kwargs",
    "FullyShardedDataParallelPlugin": "notebook_accel.config.kwargs",
    "TorchDynamoPlugin": "notebook_accel.config.kwargs",
    "GradScalerKwargs": "notebook_accel.config.kwargs",
    "InitProcessGroupKwargs": "notebook_accel.config.kwargs",
    "ProjectConfiguration": "notebook_accel.config.kwargs",
    "ProfileKwargs": "notebook_accel.config.kwargs",
    "DDPCommunicationHookType": "notebook_accel.config.kwargs",
    "find_executable_batch_size": "notebook_accel.accelerator.batch_size",
    "GeneralTracker": "notebook_accel.accelerator.tracking",
    "LoggerType": "notebook_accel.accelerator.tracking",
    "LocalSGD": "notebook_accel.accelerator.local_sgd",
    "CheckpointError": "notebook_accel.checkpoint.training_state",
    "latest_checkpoint": "notebook_accel.checkpoint.training_state",
    "load_model_weights": "notebook_accel.checkpoint.training_state",
    "DistributedType": "notebook_accel.platforms",
    "set_seed": "notebook_accel.training.seeding",
    "synchronize_rng_states": "notebook_accel.training.helpers",
    # big models (Accelerate's top-level names from accelerate.big_modeling)
    "init_empty_weights": "notebook_accel.big_modeling.meta",
    "init_on_device": "notebook_accel.big_modeling.meta",
    "dispatch_model": "notebook_accel.big_modeling.dispatch",
    "cpu_offload": "notebook_accel.big_modeling.dispatch",
    "cpu_offload_with_hook": "notebook_accel.big_modeling.dispatch",
    "disk_offload": "notebook_accel.big_modeling.dispatch",
    "load_checkpoint_and_dispatch": "notebook_accel.big_modeling.loading",
    "load_checkpoint_in_model": "notebook_accel.big_modeling.loading",
    "infer_auto_device_map": "notebook_accel.big_modeling.device_map",
    "prepare_pippy": "notebook_accel.big_modeling.pipeline",
    "get_logger": "notebook_accel.reporting.logging",
    "is_rich_available": "notebook_accel.platforms.probes",
    "progress_bar": "notebook_accel.reporting.progress",
    "set_progress_hook": "notebook_accel.reporting.progress",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from notebook_accel.accelerator.accelerator import Accelerator
    from notebook_accel.accelerator.batch_size import find_executable_batch_size
    from notebook_accel.accelerator.local_sgd import LocalSGD
    from notebook_accel.accelerator.tracking import GeneralTracker, LoggerType
    from notebook_accel.big_modeling.device_map import infer_auto_device_map
    from notebook_accel.big_modeling.dispatch import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
    )
    from notebook_accel.big_modeling.loading import (
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
    )
    from notebook_accel.big_modeling.meta import init_empty_weights, init_on_device
    from notebook_accel.big_modeling.pipeline import prepare_pippy
    from notebook_accel.checkpoint.training_state import (
        CheckpointError,
        latest_checkpoint,
        load_model_weights,
    )
    from notebook_accel.config.kwargs import (
        AORecipeKwargs,
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
        ProjectConfiguration,
        TorchDynamoPlugin,
    )
    from notebook_accel.config.settings import LaunchSettings
    from notebook_accel.launch.cluster import release_cluster
    from notebook_accel.launch.errors import PlacementError, WorkerError
    from notebook_accel.launch.launcher import debug_launcher, last_run, notebook_launcher
    from notebook_accel.launch.options import LaunchConfig
    from notebook_accel.launch.runs.detached import DetachedRun, RunLostError
    from notebook_accel.launch.runs.handle import (
        attach,
        resume,
        resume_checkpoint,
        runs,
    )
    from notebook_accel.live import LiveWorkers, start_workers
    from notebook_accel.platforms.base import DistributedType
    from notebook_accel.platforms.hardware import Hardware
    from notebook_accel.platforms.probes import is_rich_available
    from notebook_accel.platforms.registry import detect_hardware
    from notebook_accel.reporting.logging import get_logger
    from notebook_accel.reporting.progress import progress_bar, set_progress_hook
    from notebook_accel.training.data import prepare_data_loader, skip_first_batches
    from notebook_accel.training.helpers import synchronize_rng_states
    from notebook_accel.training.optimizers import GradientState
    from notebook_accel.training.parallelism import ParallelismConfig
    from notebook_accel.training.seeding import set_seed
    from notebook_accel.training.state import AcceleratorState, PartialState
    from notebook_accel.ui.panel import LaunchPanel, panel


def __getattr__(name: str) -> Any:
    from notebook_accel._lazy import resolve

    return resolve(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _WatchCudaStarts:
    """Remember where this process first starts CUDA, so that a launch after a cell (or
    a library it imported) started it can name the line: platforms/cuda_origin.py
    watches from the moment torch.cuda is imported, or, when it was imported before
    this package, from the first call that starts CUDA. Either moment comes after
    this file ran, so cuda_origin is imported then, not now."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.cuda":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        from notebook_accel.platforms import cuda_origin

        return cuda_origin.watched_torch_cuda_spec(name, path, target)

    @staticmethod
    def install() -> None:
        cuda = sys.modules.get("torch.cuda")
        if cuda is None:
            sys.meta_path.insert(0, _WatchCudaStarts())
            return
        start = getattr(cuda, "_lazy_init", None)
        if start is None or cuda.is_initialized():
            return  # cuda_origin, once imported, says it started before the package

        def lazy_init(*args: Any, **kwargs: Any) -> Any:
            from notebook_accel.platforms import cuda_origin

            if cuda._lazy_init is lazy_init:
                cuda._lazy_init = start
            cuda_origin.watch()
            return cuda._lazy_init(*args, **kwargs)

        lazy_init.__wrapped__ = start
        lazy_init.starts_cuda_watch = True
        cuda._lazy_init = lazy_init


_WatchCudaStarts.install()
