"""Configuration objects passed to `Accelerator`, with Accelerate's names and defaults.

They are plain dataclasses and import nothing heavy, so building one costs no
`import torch`. `to_kwargs()` returns only the fields a user changed, which is
what gets forwarded to the torch call each object configures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
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


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`.

    `backend=None` means: the backend that fits the device (gloo on CPU, nccl on CUDA).
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


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
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True is not supported: every process reads its own shard. "
                "Leave dispatch_batches unset."
            )
        if self.use_stateful_dataloader:
            raise ValueError("use_stateful_dataloader=True is not supported yet; leave it False.")


@dataclass
class ProjectConfiguration:
    """Where a project keeps its files (checkpoints and logs live under `project_dir`)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
