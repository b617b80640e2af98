"""Samplers and datasets that give each process its share of the data (Accelerate's semantics).

Map-style datasets are sharded by batch: with `split_batches=False` process r
takes batches r, r+P, r+2P, ... of the original loader (so the global batch is
P times the loader's); with `split_batches=True` every batch is cut into P
equal slices. When the data does not divide evenly, `even_batches=True` fills
the last batches with samples from the start of the epoch so every process
runs the same number of equal batches. Iterable datasets are sharded by
`IterableDatasetShard`; shuffles stay in step across processes through a
seedable sampler.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler


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
        num_processes: int = 1,
        process_index: int = 0,
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
                f"DataLoader's batch size ({self.batch_size}) must be a round multiple of "
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
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
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


class SkipItems(IterableDataset):
    """An iterable dataset without its first `count` items (read and dropped), in every pass."""

    def __init__(self, dataset: IterableDataset, count: int) -> None:
        self.dataset = dataset
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.count, None)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
