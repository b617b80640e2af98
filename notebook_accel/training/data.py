"""Sharding DataLoaders across processes: `prepare_data_loader`, Accelerate's function.

It builds this process's `DataLoaderShard` (training/loader.py) over a
sharded sampler or dataset (training/sharding.py), made a torchdata
`StatefulDataLoader` too when asked (training/stateful_data.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from notebook_accel.training.loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SkipBatchSampler,
    SkipDataLoader,
    SkipFirstBatches,
    copy_plan,
)
from notebook_accel.training.optimizers import GradientState
from notebook_accel.training.sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipItems,
)

# DataLoader arguments copied from the original loader; sampling ones are rebuilt.
_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


_warned_dispatch = False


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Any = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool | None = None,
    use_stateful_dataloader: bool = False,
    *,
    gradient_state: GradientState | None = None,
    platform: Any = None,
) -> DataLoaderShard:
    """`dataloader` sharded for one process: a `DataLoaderShard` reading its batches.

    Accelerate's function, with its arguments: the process count and index
    default to this process's (`PartialState`), batches go to `device` (default:
    this process's) only with `put_on_device=True`. `dispatch_batches=True` is
    accepted: each process reads the batches the main process would have sent
    it. `rng_types` and `slice_fn_for_dispatch` are accepted and change nothing
    (shuffles stay in step through a synchronised generator).

    Every prepared loader has `state_dict`/`load_state_dict`. With
    `use_stateful_dataloader=True` it is also a torchdata `StatefulDataLoader`
    whose state (sampler, dataset, worker processes) its `state_dict` carries,
    as in Accelerate; see `notebook_accel.training.stateful_data`. It needs torchdata.

    `non_blocking=None` (the default) lets the device's `platform` (default:
    this process's) choose: on CUDA, batches are pinned and copied without
    blocking (see `copy_plan`); False keeps blocking copies.
    """
    state = None
    if num_processes is None or process_index is None or (put_on_device and device is None):
        from notebook_accel.training.state import PartialState

        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
        device = state.device if device is None else device
    if put_on_device and platform is None:
        from notebook_accel.training.state import PartialState

        platform = (state or PartialState()).platform
    if dispatch_batches:
        _warn_dispatch()
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    dataset = dataloader.dataset
    synchronized_generator = None
    remainder_known = not dataloader.drop_last
    # a SkipDataLoader's skipped batches, left out before the rest is shared out
    skip = getattr(dataloader, "skip_batches", 0) if isinstance(dataloader, SkipDataLoader) else 0

    if isinstance(dataset, IterableDataset):
        if skip:
            dataset = SkipItems(dataset, skip * (dataloader.batch_size or 1))
            skip = 0
        dataset, batch_size, total = _shard_iterable(
            dataloader, dataset, num_processes, process_index, split_batches
        )
        kwargs["batch_size"] = batch_size
        if batch_size is None:
            remainder_known = False  # how many samples a batch holds is the dataset's business
        else:
            kwargs["drop_last"] = dataloader.drop_last
    else:
        sharded, synchronized_generator = _shard_batch_sampler(
            dataloader,
            skip,
            num_processes,
            process_index,
            split_batches,
            even_batches,
            use_seedable_sampler,
            data_seed,
        )
        kwargs.update(sharded)
        skip = 0  # the batch sampler skips them
        size = getattr(sharded.get("batch_sampler", sharded.get("sampler")), "batch_size", None)
        total = None if size is None else size * (1 if split_batches else num_processes)

    copying = copy_plan(
        non_blocking,
        pins_host_memory=put_on_device and getattr(platform, "pins_host_memory", False),
        user_pinned=bool(kwargs.get("pin_memory")),
        num_workers=kwargs.get("num_workers", 0),
    )
    if copying.loader_pins:
        kwargs["pin_memory"] = True
    placed = put_on_device and platform is not None
    if dispatch_batches:
        kwargs["split_batches"] = split_batches
    return _loader_class(use_stateful_dataloader, bool(dispatch_batches))(
        dataset,
        skip_batches=skip,
        device=device if put_on_device else None,
        gradient_state=gradient_state or GradientState(),
        total_batch_size=total,
        synchronized_generator=synchronized_generator,
        non_blocking=copying.non_blocking,
        remainder_known=remainder_known,
        pin_batches=copying.pin_in_copy,
        copy_stream=platform.copy_stream(device) if copying.side_stream else None,
        before_transfer=platform.before_batch_transfer if placed else None,
        **kwargs,
    )


def _batch_sampler_of(dataloader: DataLoader) -> tuple[Any, bool]:
    """The loader's batch sampler, and whether it is its `sampler` (DataLoader(sampler=
    BatchSampler(...), batch_size=None), whose items are batches)."""
    if dataloader.batch_sampler is None and isinstance(dataloader.sampler, BatchSampler):
        return dataloader.sampler, True
    if dataloader.batch_sampler is None:
        raise ValueError(
            "DataLoader(batch_size=None) yields single samples and cannot be sharded by batch; "
            "give the DataLoader a batch_size or a batch_sampler."
        )
    return dataloader.batch_sampler, False


def _shard_batch_sampler(
    dataloader: DataLoader,
    skip: int,
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    use_seedable_sampler: bool,
    data_seed: int | None,
) -> tuple[dict[str, Any], torch.Generator | None]:
    """This process's batch sampler of a map-style dataset, as DataLoader arguments, and
    the generator to keep in step across processes. `skip`: global batches each pass
    leaves out (a SkipDataLoader's), skipped before sharding."""
    batch_sampler, is_sampler = _batch_sampler_of(dataloader)
    if skip:
        batch_sampler = SkipBatchSampler(batch_sampler, skip)
    batch_sampler, synchronized_generator = _shuffling(
        batch_sampler, num_processes, use_seedable_sampler, data_seed
    )
    if num_processes > 1:
        batch_sampler = BatchSamplerShard(
            batch_sampler, num_processes, process_index, split_batches, even_batches
        )
    if is_sampler:
        return {"sampler": batch_sampler, "batch_size": None}, synchronized_generator
    return {"batch_sampler": batch_sampler}, synchronized_generator


def _shard_iterable(
    dataloader: DataLoader,
    dataset: IterableDataset,
    num_processes: int,
    process_index: int,
    split_batches: bool,
) -> tuple[IterableDataset, int | None, int | None]:
    """This process's share of `dataset` (the loader's): (dataset, its loader's batch
    size, the global batch size, None where the items are whole batches)."""
    batch_size = dataloader.batch_size
    if batch_size is None:
        # Pre-batched data: each item is a whole batch, and goes to one process whole.
        if split_batches and num_processes > 1:
            raise ValueError(
                "split_batches=True cannot split the items of DataLoader(batch_size=None) "
                "over an iterable dataset: each item is a batch already. Give the DataLoader "
                "a batch_size, or leave split_batches off."
            )
        if num_processes > 1:
            dataset = IterableDatasetShard(
                dataset, 1, dataloader.drop_last, num_processes, process_index
            )
        return dataset, None, None
    if num_processes > 1:
        dataset = IterableDatasetShard(
            dataset, batch_size, dataloader.drop_last, num_processes, process_index, split_batches
        )
    total = batch_size * (1 if split_batches else num_processes)
    return dataset, batch_size // num_processes if split_batches else batch_size, total


def _loader_class(stateful: bool, dispatch: bool) -> type[DataLoaderShard]:
    """The prepared loader's class (named DataLoaderDispatcher under dispatch_batches, as
    in Accelerate), made a torchdata StatefulDataLoader too when asked."""
    base = DataLoaderDispatcher if dispatch else DataLoaderShard
    if not stateful:
        return base
    from notebook_accel.training.stateful_data import stateful_loader_class

    return stateful_loader_class(base)


def _shuffling(
    batch_sampler: Any, num_processes: int, use_seedable_sampler: bool, data_seed: int | None
) -> tuple[Any, torch.Generator | None]:
    """The batch sampler with its shuffling made shareable, and the generator to keep in step.

    A RandomSampler becomes the seedable one, or gets a generator of its own
    that the prepared loader synchronises across processes at each pass.
    """
    synchronized_generator = None
    sampler = batch_sampler.sampler if hasattr(batch_sampler, "sampler") else None
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
            data_seed=data_seed,
        )
        if type(batch_sampler) is BatchSampler:
            batch_sampler = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        else:  # a custom batch sampler: swap its sampler in place, as Accelerate does
            batch_sampler.sampler = sampler
    elif isinstance(sampler, RandomSampler):
        # A generator of its own (seeded once from the global one) makes each
        # epoch's order a state that a checkpoint can save and restore.
        if sampler.generator is None:
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
        if num_processes > 1:
            synchronized_generator = sampler.generator
    return batch_sampler, synchronized_generator


def _warn_dispatch() -> None:
    global _warned_dispatch
    if _warned_dispatch:
        return
    _warned_dispatch = True
    import warnings

    warnings.warn(
        "dispatch_batches=True: each process reads its own batches, the ones the main process "
        "would have sent it, so the data is the same without the broadcast.",
        UserWarning,
        stacklevel=3,
    )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """`dataloader` without its first `num_batches` batches (Accelerate's function).

    For a prepared loader the skipped batches of its next pass are not read and
    no random generator moves, so a pass resumed this way after `load_state`
    continues exactly. A plain DataLoader gives a DataLoader (which `prepare`
    shards) whose every pass leaves them out: over a map-style dataset their
    indices are skipped, unread, as in Accelerate; over an iterable dataset
    they are read and dropped.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches={num_batches}; it must be 0 or more.")
    if isinstance(dataloader, DataLoaderShard) or not isinstance(dataloader, DataLoader):
        return SkipFirstBatches(dataloader, num_batches)
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None:
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        if dataloader.batch_sampler is None and not isinstance(dataloader.dataset, IterableDataset):
            kwargs["sampler"] = dataloader.sampler  # samples one by one, or batches it makes
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, **kwargs)
    batch_sampler = SkipBatchSampler(dataloader.batch_sampler, num_batches)
    return DataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)
