"""Resume is bit-identical to the uninterrupted run at 1, 2, 3 and 4 processes.

One run per world size and model wrapper (DDP, FSDP2): mid-epoch, with gradient
accumulation, dropout, a shuffled sampler and a StatefulDataLoader, without
find_unused_parameters. At 3 processes and more, where DDP puts a gradient in its
buckets decides how the all-reduce rounds its sum, and a new DDP starts in another
layout than the one the saved run's DDP had rebuilt (training/ddp_buckets.py).
"""

from __future__ import annotations

import pytest
import torch
from separate_dirs import StepCounter
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    notebook_launcher,
    set_seed,
)
from notebook_accel.training import fsdp as fsdp_module

BATCH, STEPS_PER_EPOCH, EPOCHS, ACCUMULATE = 2, 8, 2, 2
STOP_AT = 12  # batches: half way through the second epoch, after an optimizer step


def train(
    folder: str,
    fsdp: bool,
    stop_at: int | None = None,
    resume: bool = False,
    comm_hook: str = "no",
) -> list[torch.Tensor] | None:
    """Train EPOCHS epochs, first resuming from `folder` with `resume`; save into it after
    `stop_at` batches and return None, else return the final weights."""
    set_seed(0, device_specific=True)  # each rank its own dropout masks
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATE,
        fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=16) if fsdp else None,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=comm_hook)],
    )
    # layers of different sizes, used in the order they are listed: DDP's first
    # bucket layout and its rebuilt one differ
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32),
        torch.nn.Dropout(0.2),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    samples = BATCH * STEPS_PER_EPOCH * accelerator.num_processes
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 6, generator=g), torch.randn(samples, 1, generator=g))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = StepCounter()  # batches, here
    accelerator.register_for_checkpointing(counter)
    if resume:
        accelerator.load_state(folder)
    for _ in range(loader.epoch, EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            counter.steps += 1
            if counter.steps == stop_at:
                accelerator.save_state(folder)
                return None
    parameters = accelerator.unwrap_model(model).parameters()
    return [fsdp_module.full_tensor(p.detach()).clone() for p in parameters]


def _launch(world: int, *args) -> list:
    return notebook_launcher(
        train,
        args=args,
        num_processes=world,
        return_all=True,
        live=False,
        backend="cpu",
        timeout=200 if world > 1 else None,  # one process runs in this one
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_resumed_run_ends_with_the_uninterrupted_run_s_weights(world, fsdp, tmp_path):
    if fsdp and world == 1:
        pytest.skip("FSDP2 shards over two processes or more")
    uninterrupted = _launch(world, str(tmp_path / "uninterrupted"), fsdp)
    assert _launch(world, str(tmp_path / "resumed"), fsdp, STOP_AT) == [None] * world
    resumed = _launch(world, str(tmp_path / "resumed"), fsdp, None, True)
    for rank in range(world):
        for mine, theirs in zip(resumed[rank], uninterrupted[rank], strict=True):
            assert torch.equal(mine, theirs), (rank, (mine - theirs).abs().max().item())


@pytest.mark.timeout(300)
def test_a_run_with_its_own_communication_hook_resumes_with_it(tmp_path):
    # DDP takes one hook: the run's fp16 compression stays, and the resume works
    assert _launch(3, str(tmp_path), False, STOP_AT, False, "fp16") == [None] * 3
    resumed = _launch(3, str(tmp_path), False, None, True, "fp16")
    assert all(torch.isfinite(w).all() for weights in resumed for w in weights)
