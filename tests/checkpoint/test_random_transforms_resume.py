"""A dataset's own random transforms come out the same after a mid-epoch resume."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from notebook_accel import Accelerator


class Augmented(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)]) + torch.rand(1)  # a random augmentation


def prepared():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    return accelerator, accelerator.prepare(DataLoader(Augmented(), batch_size=2, shuffle=True))


def test_the_batch_read_ahead_at_the_save_is_drawn_again_the_same(tmp_path):
    _, loader = prepared()
    uninterrupted = [batch.flatten().tolist() for batch in loader]

    accelerator, loader = prepared()
    resumed = []
    for index, batch in enumerate(loader):
        resumed.append(batch.flatten().tolist())
        if index == 2:
            accelerator.save_state(tmp_path / "state")
            break
    accelerator, loader = prepared()
    accelerator.load_state(tmp_path / "state")
    resumed += [batch.flatten().tolist() for batch in loader]
    assert resumed == uninterrupted


def test_a_checkpoint_without_the_batch_read_ahead_draws_it_again(tmp_path):
    """Checkpoints saved before loaders recorded their read-ahead batch held the
    generator states before it instead: they resume exactly too."""
    from notebook_accel.training.seeding import rng_states

    _, loader = prepared()
    uninterrupted = [batch.flatten().tolist() for batch in loader]

    accelerator, loader = prepared()
    batches = iter(loader)
    resumed = [next(batches).flatten().tolist() for _ in range(2)]
    before_read_ahead = rng_states()  # the call below reads batch 3 ahead
    resumed.append(next(batches).flatten().tolist())
    accelerator.save_state(tmp_path / "state")
    older = {**loader.state_dict(), "read_ahead": None}
    older["rng_before_read_ahead"] = before_read_ahead
    batches.close()

    accelerator, loader = prepared()
    accelerator.load_state(tmp_path / "state")
    loader.load_state_dict(older)
    resumed += [batch.flatten().tolist() for batch in loader]
    assert resumed == uninterrupted
