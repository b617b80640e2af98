"""The registry of what a checkpoint saves: what goes in, in which order, and that
save_state/load_state work on it alone (no Accelerator) and through the Accelerator."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import notebook_accel.checkpoint.training_state as checkpoint_module
from notebook_accel import Accelerator, CheckpointError, ProjectConfiguration
from notebook_accel.checkpoint.training_state import CheckpointContext, load_state, save_state
from notebook_accel.training.registry import TrainingObjects


class Counter:
    """A user object for register_for_checkpointing."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _linear(inputs: int, outputs: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs)


def _weights(*models: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for model in models for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.ones(3, 4)).square().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# -- what the Accelerator registers ------------------------------------------------------------


def test_prepare_and_register_fill_the_registry_in_the_order_given():
    accelerator = Accelerator(cpu=True)
    first, second = _linear(4, 2, 0), _linear(2, 3, 1)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt_second, step_size=1)
    loader = DataLoader(TensorDataset(torch.zeros(8, 4)), batch_size=2)
    # The scheduler comes first here and is still prepared after its optimizer.
    prepared = accelerator.prepare(scheduler, first, opt_first, loader, second, opt_second)
    a, b = Counter(1), Counter(2)
    accelerator.register_for_checkpointing(a, b)

    objects = accelerator._objects
    assert objects.models == [first, second]  # one process: the models are not wrapped
    assert [o.optimizer for o in objects.optimizers] == [opt_first, opt_second]
    assert objects.optimizers == [prepared[2], prepared[5]]
    assert objects.schedulers == [prepared[0]]
    assert objects.schedulers[0].scheduler is scheduler
    assert objects.dataloaders == [prepared[3]]
    assert objects.custom_objects == [a, b]
    assert objects.counts() == {
        "models": 2,
        "optimizers": 2,
        "schedulers": 1,
        "custom_objects": 2,
        "dataloaders": 1,
    }
    assert objects.scaler is None and accelerator.scaler is None  # no fp16

    accelerator.step = 7  # the public counter is the registry's
    assert objects.step == 7
    accelerator.free_memory()
    assert objects.counts() == dict.fromkeys(objects.counts(), 0)
    assert accelerator.step == 0


def test_the_fp16_scaler_is_the_precision_settings_own_and_survives_free_memory():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator._objects.scaler is accelerator.scaler is not None
    accelerator.free_memory()
    assert accelerator._objects.scaler is accelerator.scaler


def test_objects_without_state_dict_methods_are_refused_all_named_and_nothing_is_added():
    objects = TrainingObjects()
    kept = Counter()
    with pytest.raises(ValueError) as refused:
        objects.register(kept, object(), torch.ones(2), kept)
    message = str(refused.value)
    assert "Item at index 1, `object`" in message and "Item at index 2, `Tensor`" in message
    assert "index 0" not in message and "index 3" not in message
    assert objects.custom_objects == []
    objects.register(kept)
    assert objects.custom_objects == [kept]


# -- the checkpoint code on a registry alone -------------------------------------------------


def _run() -> tuple[CheckpointContext, list]:
    first, second = _linear(4, 2, 0), _linear(2, 3, 1)
    optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()], lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = Counter(3)
    objects = TrainingObjects(
        models=[first, second],
        optimizers=[optimizer],
        schedulers=[scheduler],
        custom_objects=[counter],
        step=5,
    )
    context = CheckpointContext(objects=objects, project=ProjectConfiguration())
    return context, [first, second, optimizer, scheduler, counter]


def _state(first, second, optimizer, scheduler, counter, context) -> dict:
    return {
        "weights": _weights(first, second),
        "moments": [s["exp_avg"].clone() for s in optimizer.state_dict()["state"].values()],
        "lr": scheduler.get_last_lr(),
        "counter": counter.value,
        "step": context.objects.step,
    }


def _equal_states(a: dict, b: dict) -> bool:
    return (
        _same(a["weights"], b["weights"])
        and _same(a["moments"], b["moments"])
        and a["lr"] == b["lr"]
        and a["counter"] == b["counter"]
        and a["step"] == b["step"]
    )


def test_save_and_load_round_trip_through_a_registry_without_an_accelerator(tmp_path):
    context, (first, second, optimizer, scheduler, counter) = _run()
    _train_step(torch.nn.Sequential(first, second), optimizer)
    scheduler.step()
    saved = _state(first, second, optimizer, scheduler, counter, context)

    folder = save_state(context, tmp_path / "ckpt", safe_serialization=True)

    # The registry's order is the files' numbering; its counts are the manifest's.
    manifest = json.loads((folder / "checkpoint.json").read_text())
    assert {k: manifest[k] for k in context.objects.counts()} == context.objects.counts()
    assert {"model.safetensors", "model_1.safetensors", "optimizer.bin", "scheduler.bin"} <= set(
        manifest["files"]
    )
    assert "custom_checkpoint_0.pkl" in manifest["files"] and "scaler.pt" not in manifest["files"]
    assert torch.load(folder / "custom_checkpoint_0.pkl") == {"value": 3}

    # Move everything on, then load: everything must come back.
    for _ in range(2):
        _train_step(torch.nn.Sequential(first, second), optimizer)
        scheduler.step()
    counter.value, context.objects.step = 99, 40
    assert not _equal_states(_state(first, second, optimizer, scheduler, counter, context), saved)

    assert load_state(context, folder) == folder
    assert _equal_states(_state(first, second, optimizer, scheduler, counter, context), saved)


def test_a_registry_in_another_order_or_with_more_objects_is_refused(tmp_path):
    context, (first, second, optimizer, *_) = _run()
    folder = save_state(context, tmp_path / "ckpt", safe_serialization=True)
    before = _weights(first, second)

    context.objects.models.reverse()  # the shapes no longer fit the numbered files
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not fit model 0"):
        load_state(context, folder)
    context.objects.models.reverse()

    context.objects.register(Counter())
    with pytest.raises(CheckpointError, match="holds 1 custom_objects, but this Accelerator has 2"):
        load_state(context, folder)
    assert _same(_weights(first, second), before) and context.objects.step == 5


# -- through the Accelerator -----------------------------------------------------------------


def test_save_state_and_load_state_of_an_accelerator_round_trip_through_its_registry(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _linear(4, 2, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    def epoch() -> list[torch.Tensor]:
        seen = []
        for (x,) in loader:
            seen.append(x)
            with accelerator.accumulate(model):
                noise = torch.randn_like(x)  # the global generator is part of the state too
                accelerator.backward(model(x + noise).square().sum())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                counter.value += 1
        return seen

    epoch()
    saved = (scheduler.get_last_lr(), counter.value, accelerator.step)
    accelerator.save_state(tmp_path / "ckpt")
    batches = epoch()  # the run as it goes on uninterrupted
    weights = _weights(model)
    assert (scheduler.get_last_lr(), counter.value) != saved[:2]

    accelerator.load_state(tmp_path / "ckpt")
    assert (scheduler.get_last_lr(), counter.value, accelerator.step) == saved
    # The same shuffle (random generators) and the same weights (model, momentum, lr).
    assert _same(epoch(), batches)
    assert _same(_weights(model), weights)


# -- the checkpoint code knows no Accelerator --------------------------------------------------


def test_checkpoint_module_neither_imports_nor_reads_the_accelerator():
    source = Path(checkpoint_module.__file__).read_text()
    tree = ast.parse(source)
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name and "accelerator" in name]
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "accelerator" not in names and "Accelerator" not in names
    # Importing it alone does not pull the Accelerator in either.
    code = (
        "import sys, notebook_accel.checkpoint.training_state; "
        "sys.exit('notebook_accel.accelerator.accelerator' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
