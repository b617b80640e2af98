"""Accelerate's `accelerate.data_loader` path: the prepared loaders and their parts.

The public path of `notebook_accel.training.data`, `.loader` and `.sharding`, with
Accelerate's class names and constructor arguments; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    "prepare_data_loader": "notebook_accel.training.data",
    "skip_first_batches": "notebook_accel.training.data",
    "DataLoaderShard": "notebook_accel.training.loader",
    "DataLoaderDispatcher": "notebook_accel.training.loader",
    "SkipBatchSampler": "notebook_accel.training.loader",
    "SkipDataLoader": "notebook_accel.training.loader",
    "BatchSamplerShard": "notebook_accel.training.sharding",
    "IterableDatasetShard": "notebook_accel.training.sharding",
    "SeedableRandomSampler": "notebook_accel.training.sharding",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
