"""notebook_accel: train PyTorch models on every device of the machine from a notebook.

Public names are imported on first use so that `import notebook_accel` stays
fast and does not import torch, ipywidgets or rich until they are needed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from notebook_accel import cuda_origin
from notebook_accel._lazy import lazy_exports

__version__ = "0.1.0"

# torch.cuda.is_available() then asks NVML instead of initialising the CUDA
# driver, so a kernel that checks for GPUs can still fork CUDA workers.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# Remember where this process first starts CUDA: if a cell (or a library it
# imports) does so before a launch, the launch can name the line.
cuda_origin.watch()

# public name -> module that defines it
_EXPORTS = {
    "notebook_launcher": "notebook_accel.launch.launcher",
    "last_run": "notebook_accel.launch.launcher",
    "WorkerError": "notebook_accel.launch.errors",
    "LaunchSettings": "notebook_accel.config",
    "LaunchConfig": "notebook_accel.launch.options",
    "detect_hardware": "notebook_accel.platforms",
    "Hardware": "notebook_accel.platforms",
    "start_workers": "notebook_accel.live",
    "LiveWorkers": "notebook_accel.live",
    "panel": "notebook_accel.ui.panel",
    "LaunchPanel": "notebook_accel.ui.panel",
    "Accelerator": "notebook_accel.accelerator",
    "PartialState": "notebook_accel.state",
    "AcceleratorState": "notebook_accel.state",
    "GradientState": "notebook_accel.training",
    "GradientAccumulationPlugin": "notebook_accel.kwargs",
    "prepare_data_loader": "notebook_accel.data",
    "skip_first_batches": "notebook_accel.data",
    "AORecipeKwargs": "notebook_accel.kwargs",
    "AutocastKwargs": "notebook_accel.kwargs",
    "DataLoaderConfiguration": "notebook_accel.kwargs",
    "DistributedDataParallelKwargs": "notebook_accel.kwargs",
    "FullyShardedDataParallelPlugin": "notebook_accel.kwargs",
    "TorchDynamoPlugin": "notebook_accel.kwargs",
    "GradScalerKwargs": "notebook_accel.kwargs",
    "InitProcessGroupKwargs": "notebook_accel.kwargs",
    "ProjectConfiguration": "notebook_accel.kwargs",
    "ProfileKwargs": "notebook_accel.kwargs",
    "DDPCommunicationHookType": "notebook_accel.kwargs",
    "find_executable_batch_size": "notebook_accel.batch_size",
    "GeneralTracker": "notebook_accel.tracking",
    "LoggerType": "notebook_accel.tracking",
    "LocalSGD": "notebook_accel.local_sgd",
    "CheckpointError": "notebook_accel.checkpoint",
    "latest_checkpoint": "notebook_accel.checkpoint",
    "load_model_weights": "notebook_accel.checkpoint",
    "DistributedType": "notebook_accel.platforms",
    "set_seed": "notebook_accel.seeding",
    "get_logger": "notebook_accel.logging",
    "progress_bar": "notebook_accel.progress",
    "set_progress_hook": "notebook_accel.progress",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from notebook_accel.accelerator import Accelerator
    from notebook_accel.batch_size import find_executable_batch_size
    from notebook_accel.checkpoint import CheckpointError, latest_checkpoint, load_model_weights
    from notebook_accel.config import LaunchSettings
    from notebook_accel.data import prepare_data_loader, skip_first_batches
    from notebook_accel.kwargs import (
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
    from notebook_accel.launch.errors import WorkerError
    from notebook_accel.launch.launcher import last_run, notebook_launcher
    from notebook_accel.launch.options import LaunchConfig
    from notebook_accel.live import LiveWorkers, start_workers
    from notebook_accel.local_sgd import LocalSGD
    from notebook_accel.logging import get_logger
    from notebook_accel.platforms import DistributedType, Hardware, detect_hardware
    from notebook_accel.progress import progress_bar, set_progress_hook
    from notebook_accel.seeding import set_seed
    from notebook_accel.state import AcceleratorState, PartialState
    from notebook_accel.tracking import GeneralTracker, LoggerType
    from notebook_accel.training import GradientState
    from notebook_accel.ui.panel import LaunchPanel, panel


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
