"""An iterable dataset whose items are whole batches: DataLoader(batch_size=None).

Accelerate passes such a loader through; here each process gets every N-th batch, whole.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from notebook_accel import prepare_data_loader


class Batches(IterableDataset):
    """`count` batches of 3 rows each, numbered."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        for i in range(self.count):
            yield torch.full((3,), i)


def _ids(loader) -> list[int]:
    return [int(batch[0]) for batch in loader]


def test_one_process_gets_every_batch_as_it_is():
    loader = prepare_data_loader(DataLoader(Batches(5), batch_size=None), put_on_device=False)
    batches = list(loader)
    assert [tuple(b.shape) for b in batches] == [(3,)] * 5 and _ids(batches) == [0, 1, 2, 3, 4]


def test_two_processes_take_turns_and_the_last_round_is_completed_from_the_first():
    shares = [
        _ids(
            prepare_data_loader(
                DataLoader(Batches(5), batch_size=None),
                num_processes=2,
                process_index=rank,
                put_on_device=False,
            )
        )
        for rank in range(2)
    ]
    assert shares == [[0, 2, 4], [1, 3, 0]]


def test_split_batches_cannot_split_pre_made_batches():
    with pytest.raises(ValueError, match="each item is a batch already"):
        prepare_data_loader(
            DataLoader(Batches(4), batch_size=None),
            num_processes=2,
            process_index=0,
            split_batches=True,
            put_on_device=False,
        )
