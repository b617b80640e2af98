"""A training run whose processes save into directories of their own, for the tests.

`train` runs in every worker: 3 epochs of a small model with dropout on a
shuffled, seedable loader (6 steps per epoch whatever the world size), saving
and resuming as its arguments say. Each process saves into `base`, or into
`base/rank<N>` with `per_rank=True`, or with `node_size` one directory per
group of processes as nodes would; a test of two launcher processes gives each
loopback "node" its own `base`. With `fsdp=True` the model is sharded (FSDP2)
instead of replicated (DDP). Runs that stop, crash or restart somewhere must
end with the weights of a run that never stopped, bit for bit.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    CheckpointError,
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
    latest_checkpoint,
    set_seed,
)
from notebook_accel.checkpoint import training_state as checkpoint_module
from notebook_accel.training import fsdp as fsdp_module

BATCH, STEPS_PER_EPOCH, EPOCHS = 4, 6, 3


class StepCounter:
    """A user object saved through register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def directory(base: str | Path, per_rank: bool, node_size: int | None = None) -> Path:
    """Where this process saves: `base`, `base/rank<N>` with `per_rank`, or with
    `node_size` `base/node<N // node_size>`, as nodes of that many processes would."""
    rank = int(os.environ.get("RANK", "0"))
    if node_size:
        return Path(base) / f"node{rank // node_size}"
    return Path(base) / f"rank{rank}" if per_rank else Path(base)


def kill_in_commit(rank: int, target: str, nth: int, once_exists: list[str]):
    """A hook: SIGKILL `rank` when its `nth` save of `target` is about to be moved into
    place, once every path of `once_exists` exists (another directory's commit done)."""
    calls = []

    def hook(path: Path) -> None:
        if os.environ["RANK"] != str(rank) or not path.name.startswith(f".{target}."):
            return
        if not path.name.endswith(".partial") or path.is_file():
            return
        calls.append(path)
        if len(calls) < nth:
            return
        deadline = time.monotonic() + 60
        while not all(os.path.exists(p) for p in once_exists) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train(
    base: str,
    per_rank: bool = False,
    automatic: bool = True,
    save_on_each_node: bool = False,
    stop_at: int | None = None,
    save_every: int | None = None,
    kill: dict | None = None,
    fsdp: bool = False,
    node_size: int | None = None,
) -> dict | None:
    """Train 3 epochs, resuming from what this process's directory holds.

    automatic: checkpoint_N names under the directory (else one directory,
    `state`, replaced by each save). stop_at: save after that many steps and
    return None. save_every: save every so many steps. kill: the arguments of
    `kill_in_commit`.
    fsdp: shard the model with FSDP2 (every submodule of 16 parameters or more
    its own group); the weights returned are then the whole ones.
    node_size: the processes save in groups of that many, one directory each.
    """
    folder = directory(base, per_rank, node_size)
    set_seed(0, device_specific=True)  # each rank its own dropout masks
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=16) if fsdp else None,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(
            project_dir=str(folder),
            automatic_checkpoint_naming=automatic,
            save_on_each_node=save_on_each_node,
        ),
    )
    model, optimizer, loader, scheduler, counter = _prepared(accelerator)
    if kill is not None:
        checkpoint_module.after_written = kill_in_commit(**kill)
    state = folder / "state"
    if automatic and latest_checkpoint(folder):
        accelerator.load_state()
    elif not automatic and (state.exists() or (folder / ".state.previous").exists()):
        accelerator.load_state(state)

    def save() -> None:
        accelerator.save_state(None if automatic else state)

    for _ in range(loader.epoch, EPOCHS):
        for x, y in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.steps += 1
            if counter.steps == stop_at:
                save()
                return None
            if save_every and counter.steps % save_every == 0:
                save()
    parameters = accelerator.unwrap_model(model).parameters()
    weights = [fsdp_module.full_tensor(p.detach()).clone() for p in parameters]
    return {"weights": weights, "steps": counter.steps}


def _prepared(accelerator: Accelerator) -> tuple:
    """The run's model, optimizer, loader, scheduler and step counter, prepared."""
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    samples = BATCH * STEPS_PER_EPOCH * accelerator.num_processes
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 4, generator=g), torch.randn(samples, 1, generator=g))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    return model, optimizer, loader, scheduler, counter


def try_to_load(folder: str, fsdp: bool) -> tuple[str | None, bool]:
    """load_state(folder) in a run set up as `train`'s (sharded with `fsdp`): the
    CheckpointError's message, if any, and whether weights, optimizer state, step
    counter and learning rate are as they were."""
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=16) if fsdp else None
    )
    model, optimizer, _, scheduler, counter = _prepared(accelerator)

    def state() -> list:
        parameters = accelerator.unwrap_model(model).parameters()
        weights = [fsdp_module.full_tensor(p.detach()).clone() for p in parameters]
        return [weights, len(optimizer.state), counter.steps, scheduler.get_last_lr()]

    before = state()
    try:
        accelerator.load_state(folder)
    except CheckpointError as error:
        after = state()
        unchanged = same_weights(after[0], before[0]) and after[1:] == before[1:]
        return str(error), unchanged
    return None, False


def same_weights(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> bool:
    """Bit for bit."""
    return len(ours) == len(reference) and all(
        torch.equal(a, b) for a, b in zip(ours, reference, strict=True)
    )
