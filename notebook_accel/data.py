"""Sharding DataLoaders across processes, with Accelerate's semantics.

Map-style datasets are sharded by batch: with `split_batches=False` process r
takes batches r, r+P, r+2P, ... of the original loader (so the global batch is
P times the loader's); with `split_batches=True` every batch is cut into P
equal slices. When the data does not divide evenly, `even_batches=True` fills
the last batches with samples from the start of the epoch so every process
runs the same number of equal batches; the prepared loader reports how many
samples of its last global batch are real (`remainder`), which is what lets
`gather_for_metrics` drop the filler again.

A prepared loader also knows its position (epoch, batches of that epoch already
yielded, the shuffle generator's state at the start of the epoch), so a
checkpoint can resume it in the middle of an epoch, bit for bit.

Batches reach the device through a `BatchMover`; on a device whose host memory
can be pinned (CUDA) they are pinned and copied without blocking by default,
the next batch on a side stream while the current one trains (`copy_plan`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.dataloader import _DatasetKind

from notebook_accel import ops
from notebook_accel.nested import apply_to_tensors
from notebook_accel.seeding import preserved_rng_states, rng_states, set_rng_states
from notebook_accel.training import GradientState


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on `seed + epoch`.

    Every process draws the same permutation without communicating, and a run
    can be reproduced; the prepared DataLoader sets the epoch at each pass.
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_seed = torch.initial_seed() if data_seed is None else data_seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """The batches of `batch_sampler` that belong to one process (see the module docstring)."""

    def __init__(
        self,
        batch_sampler: Any,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        # BatchSampler.__init__ is not called: this wraps one rather than building one.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last: bool = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise ValueError(
                f"split_batches=True cuts each batch into {num_processes} equal parts, so the "
                f"DataLoader's batch size ({self.batch_size}) must be a multiple of "
                f"{num_processes}. Change the batch size or use split_batches=False."
            )

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return self._split_length(batches)
        whole, extra = divmod(batches, self.num_processes)
        if extra == 0 or self.drop_last:
            return whole
        if self.even_batches:
            return whole + 1
        return whole + (self.process_index < extra)

    def _split_length(self, batches: int) -> int:
        # A short last batch may leave this process's slice empty (even_batches=False).
        try:
            samples = len(self.batch_sampler.sampler)
        except (AttributeError, TypeError):
            return batches
        assert self.batch_size is not None
        short = samples % self.batch_size
        if self.drop_last or short == 0 or self.even_batches:
            return batches
        slice_size = self.batch_size // self.num_processes
        return batches - (short <= slice_size * self.process_index)

    def set_epoch(self, epoch: int) -> None:
        for target in (self.batch_sampler, self.sampler):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return

    def __iter__(self) -> Iterator[list]:
        if self.split_batches:
            return self._iter_split()
        return self._iter_whole()

    def _full(self, batch: list) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _iter_whole(self) -> Iterator[list]:
        procs, rank = self.num_processes, self.process_index
        first: list[list] = []  # the first round's batches: filler for an uneven end
        round_: list[list] = []  # the current round, one batch per process
        for batch in self.batch_sampler:
            batch = list(batch)
            if len(first) < procs:
                first.append(batch)
            round_.append(batch)
            if len(round_) == procs and self._full(batch):
                yield round_[rank]
                round_ = []
        if not round_ or self.drop_last:
            return
        if not self.even_batches:
            if rank < len(round_):
                yield round_[rank]
            return
        if self.batch_size is None:  # batches of free size: fill with whole early batches
            if rank < len(round_):
                yield round_[rank]
            else:
                yield first[(rank - len(round_)) % len(first)]
            return
        filler = itertools.cycle(itertools.chain.from_iterable(first))
        for index in range(procs):
            batch = round_[index] if index < len(round_) else []
            batch = batch + list(itertools.islice(filler, self.batch_size - len(batch)))
            if index == rank:
                yield batch

    def _iter_split(self) -> Iterator[list]:
        assert self.batch_size is not None
        size = self.batch_size // self.num_processes
        lo, hi = size * self.process_index, size * (self.process_index + 1)
        first: list | None = None
        short: list | None = None
        for batch in self.batch_sampler:
            batch = list(batch)
            if first is None:
                first = batch
            if len(batch) == self.batch_size:
                yield batch[lo:hi]
            else:
                short = batch
        if short is None or self.drop_last:
            return
        if self.even_batches:
            assert first is not None
            filler = itertools.cycle(first)
            short = short + list(itertools.islice(filler, self.batch_size - len(short)))
        if len(short) > lo:
            yield short[lo:hi]


class IterableDatasetShard(IterableDataset):
    """The items of an iterable dataset that belong to one process.

    Items are read in rounds of one global batch; process r keeps its slice of
    each round. An incomplete last round is completed from the first round,
    unless `drop_last`.
    """

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        drop_last: bool = False,
    ) -> None:
        if split_batches and batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size ({batch_size}) that is a multiple of "
                f"the number of processes ({num_processes})."
            )
        self.dataset = dataset
        self.drop_last = drop_last
        self.round_size = batch_size if split_batches else batch_size * num_processes
        self.slice_size = self.round_size // num_processes
        self.process_index = process_index

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_length(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        rounds = len(self.dataset) / self.round_size  # type: ignore[arg-type]
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.slice_size

    def __iter__(self) -> Iterator[Any]:
        lo = self.slice_size * self.process_index
        first: list | None = None
        round_: list = []
        for item in self.dataset:
            round_.append(item)
            if len(round_) == self.round_size:
                yield from round_[lo : lo + self.slice_size]
                first = first or round_
                round_ = []
        if round_ and not self.drop_last:
            filler = itertools.cycle(first or round_)
            round_ += list(itertools.islice(filler, self.round_size - len(round_)))
            yield from round_[lo : lo + self.slice_size]


@dataclass(frozen=True)
class CopyPlan:
    """How a prepared loader's batches go to the device (see `copy_plan`)."""

    non_blocking: bool = False
    pin_in_copy: bool = False  # pin CPU tensors just before copying them
    loader_pins: bool = False  # the DataLoader pins (pin_memory=True), in its own thread
    side_stream: bool = False  # copy the next batch on a side stream while this one trains


def copy_plan(
    non_blocking: bool | None, pins_host_memory: bool, user_pinned: bool, num_workers: int
) -> CopyPlan:
    """Decide how batches are copied to the device.

    A blocking copy from pageable memory makes the host wait until the device
    has finished every queued step before it can queue the next one (measured:
    0.92x of a pinned, non-blocking loop on a small transformer on an H200).
    So where host memory can be pinned (`pins_host_memory`: CUDA) and
    `non_blocking` is not False, batches are pinned and copied without blocking:
    pinned by the DataLoader when the person asked for it (`user_pinned`: never
    twice) or when it has worker processes (its pinning thread then overlaps with
    training), else just before the copy (only CPU tensors, so a dataset that
    yields tensors on the GPU keeps working). `non_blocking=False` keeps
    blocking copies; elsewhere `non_blocking` is passed to `.to()` as given.
    """
    if not pins_host_memory:
        return CopyPlan(non_blocking=bool(non_blocking))
    if non_blocking is False:
        return CopyPlan()
    loader_pins = user_pinned or num_workers > 0
    return CopyPlan(
        non_blocking=True,
        pin_in_copy=not loader_pins,
        loader_pins=loader_pins,
        side_stream=True,
    )


class BatchMover:
    """Copies batches (nested tensors) to one device, as a `CopyPlan` says.

    `start` queues the copy; `ready` makes the batch safe to use on the stream
    that trains. With a side `stream` the copy runs there, so the prepared
    loader can start the next batch's copy before handing out the current batch;
    `ready` then makes the training stream wait for that copy, and tells the
    allocator the batch is used there, so its memory is not reused too early.
    """

    def __init__(
        self,
        device: torch.device,
        non_blocking: bool = False,
        pin: bool = False,
        stream: Any = None,
    ) -> None:
        self.device = device
        self.non_blocking = non_blocking
        self.pin = pin
        self.stream = stream

    def start(self, batch: Any) -> Any:
        """The batch on the device, its copy queued (on the side stream, if any)."""
        if self.stream is None:
            return apply_to_tensors(self._copy, batch)
        with torch.get_device_module(self.device).stream(self.stream):
            return apply_to_tensors(self._copy, batch)

    def ready(self, batch: Any) -> Any:
        """`batch`, usable on the current (training) stream."""
        if self.stream is None:
            return batch
        current = torch.get_device_module(self.device).current_stream(self.device)
        current.wait_stream(self.stream)

        def used_here(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == self.device.type:
                tensor.record_stream(current)
            return tensor

        return apply_to_tensors(used_here, batch)

    def __getstate__(self) -> dict:
        # A stream cannot be pickled (an Accelerator with its loaders can): a copy
        # made from the pickle copies on the current stream.
        return {**self.__dict__, "stream": None}

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.pin and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=self.non_blocking)


class DataLoaderShard(DataLoader):
    """A DataLoader that yields this process's batches, on its device.

    It looks one batch ahead so that, while the last batch is in use,
    `end_of_dataloader` is True; `remainder` is the number of real samples in
    the last global batch. A pass counts as an epoch: the sampler's epoch is set
    at the start of each (`set_epoch` overrides the count).

    `state_dict()`/`load_state_dict()` save and restore its position: after a
    load, the next pass continues the saved epoch after the batches already
    yielded, drawing the same batches in the same order.

    `pin_batches` and `copy_stream` (see `copy_plan` and `BatchMover`): pin CPU
    tensors before copying them, and copy on this side stream, one batch ahead.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        device: torch.device | None,
        gradient_state: GradientState,
        total_batch_size: int | None,
        synchronized_generator: torch.Generator | None = None,
        non_blocking: bool = False,
        remainder_known: bool = True,
        pin_batches: bool = False,
        copy_stream: Any = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, **loader_kwargs)
        self.device = device
        self.mover = (
            None if device is None else BatchMover(device, non_blocking, pin_batches, copy_stream)
        )
        self.gradient_state = gradient_state
        self.total_batch_size = total_batch_size
        self.synchronized_generator = synchronized_generator
        self.non_blocking = non_blocking
        self.remainder_known = remainder_known
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        self._position = 0  # batches of the current epoch already yielded
        self._resume_skip = 0  # batches the next pass skips (set by a resume)
        # The generators just before the latest read-ahead, and on a resume, those
        # to read the saved run's read-ahead batch with again.
        self._rng_before_read_ahead: dict | None = None
        self._resume_rng_states: dict | None = None
        self._index_skip = 0  # handed to the index sampler when torch builds an iterator
        self._pass_generator_state: torch.Tensor | None = None

    @property
    def total_dataset_length(self) -> int:
        total = getattr(self.dataset, "total_length", None)
        return len(self.dataset) if total is None else total

    @property
    def epoch(self) -> int:
        """The epoch the current (or next) pass reads; restored by `load_state_dict`."""
        return self.iteration

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s shuffle order from the next pass on (counted up after each pass).

        Setting another epoch than a resumed one cancels the resume.
        """
        if epoch != self.iteration:
            self._cancel_resume()
        self.iteration = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        elif hasattr(getattr(self.batch_sampler, "sampler", None), "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _cancel_resume(self) -> None:
        """Forget a loaded position: the next pass starts its epoch from the beginning."""
        self._resume_skip = 0
        self._resume_rng_states = None

    def _snapshot(self) -> None:
        """Called with each batch read, before the next one is read ahead (a hook for
        loaders that record more of their state than the position)."""

    def _to_device(self, batch: Any) -> Any:
        """Queue `batch`'s copy to the device (`_ready` hands it out)."""
        if self.mover is None:
            return batch
        return self.mover.start(batch)

    def _ready(self, batch: Any) -> Any:
        return batch if self.mover is None else self.mover.ready(batch)

    @property
    def _copies_ahead(self) -> bool:
        """Whether the next batch's copy starts before the current batch is handed out."""
        return self.mover is not None and self.mover.stream is not None

    def _start(self) -> None:
        if self.synchronized_generator is not None:
            # Every process must shuffle alike: take process 0's generator state.
            ops.sync_generator(self.synchronized_generator)
        self.set_epoch(self.iteration)
        generator = self._shuffle_generator()
        self._pass_generator_state = None if generator is None else generator.get_state()
        self.end_of_dataloader = False
        self.remainder = -1
        if self.remainder_known and self.total_batch_size:
            try:
                self.remainder = self.total_dataset_length % self.total_batch_size
            except TypeError:  # a dataset without a length
                pass
        self.gradient_state.active_dataloaders.append(self)

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume_skip = self._resume_skip, 0
        self._start()
        self._position = skip
        try:
            # A resumed pass re-creates what the saved run had already done when
            # it saved (the iterator, whose creation draws a seed from the global
            # generator, and the batch read ahead), so it must not move any
            # generator: the saved states already include those draws.
            with preserved_rng_states() if skip else contextlib.nullcontext():
                batches = self._batches(skip)
                if skip and self._resume_rng_states is not None:
                    # The batch read ahead at the save was drawn with the generators
                    # as they were then (random transforms in the dataset): again.
                    set_rng_states(self._resume_rng_states)
                current = next(batches, _END)
            self._resume_rng_states = None
            ahead = self._copies_ahead
            if ahead and current is not _END:
                current = self._to_device(current)
            while current is not _END:
                if not ahead:
                    current = self._to_device(current)
                self._rng_before_read_ahead = rng_states()
                self._snapshot()
                following = next(batches, _END)
                self.end_of_dataloader = following is _END
                if ahead and following is not _END:
                    following = self._to_device(following)  # overlaps this batch's step
                self._position += 1
                yield self._ready(current)
                current = following
            self.iteration += 1
            self._position = 0
        finally:
            self.gradient_state.active_dataloaders.remove(self)

    def _batches(self, skip: int) -> Iterator[Any]:
        """torch's iterator over this pass, after the first `skip` batches."""
        if self._dataset_kind == _DatasetKind.Iterable:
            return itertools.islice(super().__iter__(), skip, None)
        self._index_skip = skip  # map-style: skip indices, without reading the data
        return super().__iter__()

    @property
    def _index_sampler(self) -> Any:
        # torch reads batch indices through this property when it builds (or, with
        # persistent workers, resets) an iterator; the wrapper lets a resumed pass
        # start after the batches already trained on.
        return _SkipFirstIndices(super()._index_sampler, self)

    def _shuffle_generator(self) -> torch.Generator | None:
        """The generator a plain RandomSampler shuffles with (the seedable one reseeds itself)."""
        sampler = getattr(self.batch_sampler, "sampler", None)
        if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
            return sampler.generator
        return None

    def state_dict(self) -> dict:
        """Where this loader stands: epoch, batches of it yielded, and the shuffle state."""
        generator = self._shuffle_generator()
        if self._position:
            generator_state = self._pass_generator_state
        else:
            generator_state = None if generator is None else generator.get_state()
        sampler = getattr(self.batch_sampler, "sampler", None)
        return {
            "epoch": self.iteration,
            "batches_yielded": self._position,
            "generator_state": generator_state,
            "sampler_seed": getattr(sampler, "initial_seed", None),
            "rng_before_read_ahead": self._rng_before_read_ahead if self._position else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`: the next pass continues its epoch after the batches yielded."""
        self.set_epoch(state["epoch"])
        self._resume_skip = state["batches_yielded"]
        self._resume_rng_states = state.get("rng_before_read_ahead")
        generator = self._shuffle_generator()
        if generator is not None and state.get("generator_state") is not None:
            generator.set_state(state["generator_state"])
        sampler = getattr(self.batch_sampler, "sampler", None)
        if state.get("sampler_seed") is not None and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = state["sampler_seed"]

    def skip_next_pass_batches(self, num_batches: int) -> None:
        """Make the next pass start at batch `num_batches` of its epoch (a resume)."""
        self._resume_skip = num_batches


class _SkipFirstIndices:
    """A loader's batch sampler that skips the batches its loader was told to skip."""

    def __init__(self, sampler: Any, loader: DataLoaderShard) -> None:
        self.sampler = sampler
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        skip = getattr(self.loader, "_index_skip", 0)
        self.loader._index_skip = 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)


class SkipFirstBatches:
    """A DataLoader whose next passes leave out their first `num_batches` batches.

    What `Accelerator.skip_first_batches` returns. For a prepared loader the
    skipped batches are not read at all and no random generator moves, so a
    pass resumed this way after `load_state` continues exactly; its position
    keeps counting in the prepared loader, so saving inside it stays exact too.
    A plain DataLoader's first batches are read and dropped.
    """

    def __init__(self, dataloader: Any, num_batches: int) -> None:
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches}; it must be 0 or more.")
        self.dataloader = dataloader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.dataloader, DataLoaderShard):
            self.dataloader.skip_next_pass_batches(self.num_batches)
            return iter(self.dataloader)
        return itertools.islice(iter(self.dataloader), self.num_batches, None)

    def __len__(self) -> int:
        return max(len(self.dataloader) - self.num_batches, 0)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)


_END = object()

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
    loader_class: type[DataLoaderShard] | None = None,
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
    as in Accelerate; see `notebook_accel.stateful_data`. It needs torchdata.

    `non_blocking=None` (the default) lets the device's `platform` (default:
    this process's) choose: on CUDA, batches are pinned and copied without
    blocking (see `copy_plan`); False keeps blocking copies.
    """
    state = None
    if num_processes is None or process_index is None or (put_on_device and device is None):
        from notebook_accel.state import PartialState

        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
        device = state.device if device is None else device
    if put_on_device and platform is None:
        from notebook_accel.state import PartialState

        platform = (state or PartialState()).platform
    if dispatch_batches:
        _warn_dispatch()
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    dataset = dataloader.dataset
    synchronized_generator = None
    remainder_known = not dataloader.drop_last

    if isinstance(dataset, IterableDataset):
        batch_size = dataloader.batch_size
        if batch_size is None:
            raise ValueError(
                "An iterable dataset needs a DataLoader with a batch_size to be sharded."
            )
        if num_processes > 1:
            dataset = IterableDatasetShard(
                dataset,
                batch_size,
                num_processes,
                process_index,
                split_batches,
                dataloader.drop_last,
            )
            batch_size = batch_size // num_processes if split_batches else batch_size
        kwargs.update(batch_size=batch_size, drop_last=dataloader.drop_last)
        total = dataloader.batch_size * (1 if split_batches else num_processes)
    else:
        batch_sampler = dataloader.batch_sampler
        # DataLoader(sampler=BatchSampler(...), batch_size=None): each item is a batch
        sampler_gives_batches = batch_sampler is None and isinstance(
            dataloader.sampler, BatchSampler
        )
        if sampler_gives_batches:
            batch_sampler = dataloader.sampler
        if batch_sampler is None:
            raise ValueError(
                "DataLoader(batch_size=None) yields single samples and cannot be sharded by batch; "
                "give the DataLoader a batch_size or a batch_sampler."
            )
        batch_sampler, synchronized_generator = _shuffling(
            batch_sampler, num_processes, use_seedable_sampler, data_seed
        )
        if num_processes > 1:
            batch_sampler = BatchSamplerShard(
                batch_sampler, num_processes, process_index, split_batches, even_batches
            )
        if sampler_gives_batches:
            kwargs.update(sampler=batch_sampler, batch_size=None)
        else:
            kwargs["batch_sampler"] = batch_sampler
        size = getattr(batch_sampler, "batch_size", None)
        total = None if size is None else size * (1 if split_batches else num_processes)

    copying = copy_plan(
        non_blocking,
        pins_host_memory=put_on_device and getattr(platform, "pins_host_memory", False),
        user_pinned=bool(kwargs.get("pin_memory")),
        num_workers=kwargs.get("num_workers", 0),
    )
    if copying.loader_pins:
        kwargs["pin_memory"] = True
    return _loader_class(loader_class, use_stateful_dataloader)(
        dataset,
        device=device if put_on_device else None,
        gradient_state=gradient_state or GradientState(),
        total_batch_size=total,
        synchronized_generator=synchronized_generator,
        non_blocking=copying.non_blocking,
        remainder_known=remainder_known,
        pin_batches=copying.pin_in_copy,
        copy_stream=platform.copy_stream(device) if copying.side_stream else None,
        **kwargs,
    )


def _loader_class(base: type[DataLoaderShard] | None, stateful: bool) -> type[DataLoaderShard]:
    """The prepared loader's class: the platform's, made a torchdata StatefulDataLoader too
    when asked."""
    base = base or DataLoaderShard
    if not stateful:
        return base
    from notebook_accel.stateful_data import stateful_loader_class

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

    For a prepared loader the skipped batches are not read and no random
    generator moves; a plain DataLoader's are read and dropped.
    """
    return SkipFirstBatches(dataloader, num_batches)
