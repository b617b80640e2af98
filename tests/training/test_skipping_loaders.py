"""skip_first_batches of a plain DataLoader, the skipping sampler and loader, the prepared
loader's class names and constructor: what Accelerate's `accelerate.data_loader` offers."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from notebook_accel import Accelerator, DataLoaderConfiguration, notebook_launcher
from notebook_accel.data_loader import (
    DataLoaderDispatcher,
    DataLoaderShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from notebook_accel.training import data as data_module
from tests_support import dev_dependency


class Stream(IterableDataset):
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        yield from range(self.count)


def _rows(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_skip_first_batches_of_a_plain_loader_is_a_loader_that_skips_every_pass():
    skipping = skip_first_batches(DataLoader(list(range(16)), batch_size=4), 2)
    assert isinstance(skipping, DataLoader)
    assert isinstance(skipping.batch_sampler, SkipBatchSampler)  # indices skipped, unread
    assert len(skipping) == 2
    assert _rows(skipping) == _rows(skipping) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=4), 1)
    assert isinstance(stream, SkipDataLoader) and _rows(stream) == [[4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="0 or more"):
        skip_first_batches(DataLoader(list(range(4))), -1)


@pytest.mark.parametrize("iterable", [False, True])
def test_a_skipping_loader_prepared_for_two_processes_skips_the_loader_s_batches(iterable):
    data = Stream(16) if iterable else list(range(16))
    shares = []
    for rank in range(2):
        skipping = skip_first_batches(DataLoader(data, batch_size=2), 2)
        shares.append(_rows(prepare_data_loader(skipping, num_processes=2, process_index=rank)))
    # the loader's first two batches (items 0-3) are gone before the rest is shared out
    rest = DataLoader(list(range(4, 16)), batch_size=2)
    assert shares == [
        _rows(prepare_data_loader(rest, num_processes=2, process_index=r)) for r in range(2)
    ]


def test_skip_batch_sampler_lets_prepare_share_the_shuffle_of_the_sampler_inside():
    inner = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=True)
    skipping = SkipBatchSampler(inner, 1)
    assert (skipping.batch_size, skipping.drop_last, skipping.total_length) == (2, True, 4)
    seedable = SeedableRandomSampler(range(8), data_seed=3)
    skipping.sampler = seedable  # what use_seedable_sampler does to a custom batch sampler
    assert inner.sampler is seedable and len(list(skipping)) == 3


def test_the_prepared_loader_is_a_dispatcher_under_dispatch_batches_and_pickles(monkeypatch):
    monkeypatch.setattr(data_module, "_warned_dispatch", False)  # warned once per process
    data = DataLoader(list(range(10)), batch_size=2)
    for dispatch, kind in ((False, DataLoaderShard), (True, DataLoaderDispatcher)):
        config = DataLoaderConfiguration(dispatch_batches=dispatch)
        accelerator = Accelerator(cpu=True, dataloader_config=config)
        with pytest.warns(UserWarning) if dispatch else _no_warning():
            loader, skipping = accelerator.prepare(data, skip_first_batches(data, 2))
        assert type(loader) is kind and isinstance(loader, DataLoaderShard)
        copy = pickle.loads(pickle.dumps(accelerator))
        assert [type(dl) for dl in copy._dataloaders] == [kind, kind]
        assert _rows(copy._dataloaders[0]) == _rows(loader)
        assert _rows(copy._dataloaders[1]) == _rows(loader)[2:] == _rows(skipping)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_prepared_loader_classes_are_made_directly_as_in_accelerate():
    shard = DataLoaderShard(list(range(16)), batch_size=4, skip_batches=1)
    for _ in range(2):  # every pass skips, and the end is known one batch ahead
        ends = [shard.end_of_dataloader for _ in shard]
        assert ends == [False, False, True]
    assert _rows(shard) == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    dispatcher = DataLoaderDispatcher(range(6), batch_size=3, split_batches=True)
    assert dispatcher.split_batches and _rows(dispatcher) == [[0, 1, 2], [3, 4, 5]]


def test_use_stateful_dataloader_makes_the_class_stateful_and_it_resumes():
    stateful = dev_dependency("torchdata.stateful_dataloader").StatefulDataLoader
    for kind in (DataLoaderShard, DataLoaderDispatcher, SkipDataLoader):
        loader = kind(list(range(16)), batch_size=4, use_stateful_dataloader=True)
        assert isinstance(loader, stateful) and isinstance(loader, kind)
        assert loader.use_stateful_dataloader
        seen = []
        for index, batch in enumerate(loader):
            seen.append(batch.tolist())
            if index == 1:
                state = loader.state_dict()
        again = kind(list(range(16)), batch_size=4, use_stateful_dataloader=True)
        again.load_state_dict(state)
        assert _rows(again) == seen[2:], kind
        assert pickle.loads(pickle.dumps(again)).use_stateful_dataloader


def test_set_epoch_reaches_the_sampler_inside_a_batch_sampler_with_its_own_set_epoch():
    class Epochs(BatchSampler):
        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = SeedableRandomSampler(range(8), data_seed=0)
    loader = DataLoaderShard(range(8), batch_sampler=Epochs(sampler, 2, False))
    loader.set_epoch(3)
    assert sampler.epoch == 3 and loader.batch_sampler.epoch == 3


def _skipping_worker():
    accelerator = Accelerator()
    data = DataLoader(torch.arange(12), batch_size=2)
    loader = accelerator.prepare(accelerator.skip_first_batches(data, 2))
    mine = [batch.tolist() for batch in loader]
    return accelerator.gather_for_metrics(torch.tensor(sum(mine, []))).tolist()


@pytest.mark.timeout(120)
def test_two_workers_prepare_a_skipping_loader_and_share_its_batches():
    gathered = notebook_launcher(_skipping_worker, num_processes=2, backend="cpu")
    # without sharding each worker would read all 8 remaining items: 16 gathered
    assert sorted(gathered) == list(range(4, 12))
