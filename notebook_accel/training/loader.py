"""The prepared DataLoader: this process's batches, on its device, with its position.

A `DataLoaderShard` looks one batch ahead so that, while the last batch is in
use, it knows the epoch ends (`end_of_dataloader`) and how many samples of the
last global batch are real (`remainder`), which is what lets
`gather_for_metrics` drop the filler of `even_batches`. It also knows its
position (epoch, batches of that epoch already yielded, the shuffle
generator's state at the start of the epoch), so a checkpoint can resume it in
the middle of an epoch, bit for bit.

Batches reach the device through a `BatchMover`; on a device whose host memory
can be pinned (CUDA) they are pinned and copied without blocking by default,
the next batch on a side stream while the current one trains (`copy_plan`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data.dataloader import _DatasetKind

from notebook_accel.training import ops
from notebook_accel.training.nested import apply_to_tensors
from notebook_accel.training.optimizers import GradientState
from notebook_accel.training.seeding import preserved_rng_states, set_rng_states
from notebook_accel.training.sharding import SeedableRandomSampler

_END = object()


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


# A batch smaller than this is copied on the training stream, as a hand-written loop
# does: its copy takes the GPU a few microseconds, less than the side stream's own
# bookkeeping costs the host (stream switch, an event, record_stream) in a step that
# is bound by the host (bench/gpu_breakdown.py, the mlp model). Larger batches (images,
# long sequences) are copied on the side stream while the previous step trains.
SIDE_STREAM_MIN_BYTES = 1 << 20


class _Queued:
    """A batch whose copy to the device is queued, with the event that ends its copy
    on the side stream (None: copied on the training stream, usable as it is)."""

    __slots__ = ("batch", "copied")

    def __init__(self, batch: Any, copied: Any = None) -> None:
        self.batch = batch
        self.copied = copied


def _nbytes(data: Any) -> int:
    """Bytes of the tensors in nested lists, tuples and dicts."""
    if isinstance(data, torch.Tensor):
        return data.nelement() * data.element_size()
    if isinstance(data, (list, tuple)):
        return sum(_nbytes(item) for item in data)
    if isinstance(data, Mapping):
        return sum(_nbytes(item) for item in data.values())
    return 0


class BatchMover:
    """Copies batches (nested tensors) to one device, as a `CopyPlan` says.

    `start` queues the copy and `ready` hands the batch out, usable on the stream
    that trains. With a side `stream`, a loader's batches of at least
    `SIDE_STREAM_MIN_BYTES` (its first batch decides) are copied there, so the
    prepared loader can start the next batch's copy before handing out the current
    one; `ready` then makes the training stream wait for that batch's own copy (an
    event recorded after it, not every copy queued so far) and tells the allocator
    the batch is used there, so its memory is not reused too early. Smaller batches
    are copied on the training stream: nothing to wait for. Nothing here makes the
    host wait for the device.
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
        self.uses_stream: bool | None = None  # decided by the first batch's size

    def start(self, batch: Any) -> _Queued:
        """The batch's copy to the device, queued (on the side stream, if it pays)."""
        if self.stream is None:
            return _Queued(apply_to_tensors(self._copy, batch))
        if self.uses_stream is None:
            self.uses_stream = _nbytes(batch) >= SIDE_STREAM_MIN_BYTES
        if not self.uses_stream:
            return _Queued(apply_to_tensors(self._copy, batch))
        with torch.get_device_module(self.device).stream(self.stream):
            moved = apply_to_tensors(self._copy, batch)
            return _Queued(moved, self.stream.record_event())

    def ready(self, queued: _Queued) -> Any:
        """The batch of `queued`, usable on the current (training) stream."""
        if queued.copied is None:
            return queued.batch
        current = torch.get_device_module(self.device).current_stream(self.device)
        current.wait_event(queued.copied)

        def used_here(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == self.device.type:
                tensor.record_stream(current)
            return tensor

        return apply_to_tensors(used_here, queued.batch)

    def __getstate__(self) -> dict:
        # A stream cannot be pickled (an Accelerator with its loaders can): a copy
        # made from the pickle copies on the current stream.
        return {**self.__dict__, "stream": None}

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        # pin_memory() returns a pinned tensor as it is: no is_pinned() first (a driver call)
        if self.pin and tensor.device.type == "cpu":
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

    `skip_batches`: each pass leaves out its first batches, unread (Accelerate's
    argument). Made directly, `DataLoaderShard(dataset, batch_size=4)`, it is one
    process's loader over the whole dataset, its batches left where they are
    without a `device`.

    `pin_batches` and `copy_stream` (see `copy_plan` and `BatchMover`): pin CPU
    tensors before copying them, and copy on this side stream, one batch ahead.
    `before_transfer` is called before each batch goes to the device (the
    platform's `before_batch_transfer`: on XLA, cutting the lazy graph).
    """

    use_stateful_dataloader = False  # True on the torchdata-stateful classes

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        # Accelerate's constructor argument: made a torchdata StatefulDataLoader too
        if use_stateful_dataloader and not cls.use_stateful_dataloader:
            from notebook_accel.training.stateful_data import stateful_loader_class

            cls = stateful_loader_class(cls)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        *,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        gradient_state: GradientState | None = None,
        total_batch_size: int | None = None,
        non_blocking: bool = False,
        remainder_known: bool = True,
        pin_batches: bool = False,
        copy_stream: Any = None,
        before_transfer: Callable[[], None] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        del use_stateful_dataloader  # chose the class in __new__
        super().__init__(dataset, **loader_kwargs)
        if total_batch_size is None and self.batch_size is not None:
            total_batch_size = self.batch_size  # made directly: one process's batches
        self.device = device
        self.skip_batches = skip_batches
        self.before_transfer = before_transfer
        self.mover = (
            None if device is None else BatchMover(device, non_blocking, pin_batches, copy_stream)
        )
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        self.total_batch_size = total_batch_size
        self.synchronized_generator = synchronized_generator
        self.non_blocking = non_blocking
        self.remainder_known = remainder_known
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        self._position = 0  # batches of the current epoch already yielded
        self._resume_skip = 0  # batches the next pass skips (set by a resume)
        # The batch read ahead of the one in use (a save records it: see __iter__).
        self._read_ahead: Any = _END
        # On a resume: the saved run's read-ahead batch (in a 1-tuple), or, from an
        # older checkpoint that recorded none, the generator states to read it again with.
        self._resume_batch: tuple | None = None
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
        # the sampler inside a custom batch sampler too, whether or not that one has
        # set_epoch of its own (as Accelerate does)
        if hasattr(getattr(self.batch_sampler, "sampler", None), "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _cancel_resume(self) -> None:
        """Forget a loaded position: the next pass starts its epoch from the beginning."""
        self._resume_skip = 0
        self._resume_batch = self._resume_rng_states = None

    def _snapshot(self) -> None:
        """Called with each batch read, before the next one is read ahead (a hook for
        loaders that record more of their state than the position)."""

    def _to_device(self, batch: Any) -> Any:
        """Queue `batch`'s copy to the device (`_ready` hands it out)."""
        if self.mover is None:
            return batch
        if self.before_transfer is not None:
            self.before_transfer()
        return self.mover.start(batch)

    def _ready(self, queued: Any) -> Any:
        return queued if self.mover is None else self.mover.ready(queued)

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
        skip, self._resume_skip = self._resume_skip or self.skip_batches, 0
        saved, self._resume_batch = self._resume_batch, None
        replay, self._resume_rng_states = self._resume_rng_states, None
        self._start()
        self._position = skip
        try:
            # A resumed pass re-creates what the saved run had already done when
            # it saved (the iterator, whose creation draws a seed from the global
            # generator, and the batch read ahead), so it must not move any
            # generator: the saved states already include those draws. The batch
            # the saved run had read ahead comes from the checkpoint itself (random
            # transforms in the dataset drew it with generators as they were before
            # the read-ahead, which no save can know later); the one read here
            # again only moves the iterator past it.
            with preserved_rng_states() if skip else contextlib.nullcontext():
                batches = self._batches(skip)
                if skip and saved is None and replay is not None:
                    set_rng_states(replay)
                current = next(batches, _END)
                if saved is not None:
                    current = saved[0]
            ahead = self._copies_ahead
            if ahead and current is not _END:
                current = self._to_device(current)
            while current is not _END:
                if not ahead:
                    current = self._to_device(current)
                self._snapshot()
                following = next(batches, _END)
                self._read_ahead = following
                self.end_of_dataloader = following is _END
                if ahead and following is not _END:
                    following = self._to_device(following)  # overlaps this batch's step
                self._position += 1
                yield self._ready(current)
                current = following
            self.iteration += 1
            self._position = 0
        finally:
            self._read_ahead = _END
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
        """Where this loader stands: epoch, batches of it yielded, the shuffle state, and
        the batch already read ahead (a resume hands it out first, exactly as it was)."""
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
            # the next batch, already read (as it was before any copy to the device)
            "read_ahead": (self._read_ahead,)
            if self._position and self._read_ahead is not _END
            else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`: the next pass continues its epoch after the batches yielded."""
        self.set_epoch(state["epoch"])
        self._resume_skip = state["batches_yielded"]
        self._resume_batch = state.get("read_ahead")
        self._resume_rng_states = state.get("rng_before_read_ahead")  # an older checkpoint
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


class DataLoaderDispatcher(DataLoaderShard):
    """The prepared loader of `dispatch_batches=True` (Accelerate's class name).

    Accelerate's dispatcher reads every batch on the main process and sends each
    process its part; this one has each process read, by itself, the part the
    main process would have sent it, so the data is the same without the
    broadcast. `split_batches` is accepted for the constructor Accelerate has.
    """

    def __init__(self, dataset: Any, split_batches: bool = False, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.split_batches = split_batches


class SkipBatchSampler(BatchSampler):
    """`batch_sampler` without its first `skip_batches` batches, in every pass."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        # BatchSampler.__init__ is not called: this wraps one rather than building one.
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)

    @property
    def total_length(self) -> int:
        """The batches of a pass, the skipped ones included."""
        return len(self.batch_sampler)

    # what the wrapped sampler is made of, read and set through this one (prepare
    # shares its shuffling and counts its batch size)
    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        self.batch_sampler.sampler = sampler

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return getattr(self.batch_sampler, "drop_last", False)


class SkipDataLoader(DataLoader):
    """A DataLoader whose every pass leaves out its first `skip_batches` batches
    (what `skip_first_batches` makes of a plain DataLoader over an iterable dataset).
    `use_stateful_dataloader=True` makes it a torchdata StatefulDataLoader too."""

    use_stateful_dataloader = False

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        if use_stateful_dataloader and not cls.use_stateful_dataloader:
            from notebook_accel.training.stateful_data import stateful_skip_loader_class

            cls = stateful_skip_loader_class(cls)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        del use_stateful_dataloader  # chose the class in __new__
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(super().__iter__(), self.skip_batches, None)

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


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
