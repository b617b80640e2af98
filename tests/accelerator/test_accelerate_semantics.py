"""Accelerator behaviour that code written for Accelerate relies on, in one process.

Each test names what Accelerate does; where this package chose otherwise (docs/porting.md,
"Porting from Accelerate") the test says so.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    CheckpointError,
    GradientState,
    LaunchSettings,
    PartialState,
    ProjectConfiguration,
)
from notebook_accel.state import AcceleratorState

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LaunchSettings().to_env())


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    """Each test starts as a plain process with fresh shared states."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _components(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4)
    return model, optimizer, scheduler, loader


# -- project_dir and ProjectConfiguration --------------------------------------------------


def test_project_dir_fills_a_configuration_that_names_no_directory(tmp_path):
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_dir=tmp_path, project_config=config, log_with="tensorboard")
    assert accelerator.project_dir == str(tmp_path) == accelerator.logging_dir
    model, optimizer = accelerator.prepare(*_components()[:2])
    saved = [accelerator.save_state() for _ in range(3)]
    assert [os.path.basename(path) for path in saved] == [f"checkpoint_{i}" for i in range(3)]
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 deleted the first


def test_a_directory_in_the_configuration_wins_over_project_dir(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path / "mine"), logging_dir="logs")
    accelerator = Accelerator(project_dir=tmp_path / "other", project_config=config)
    assert (accelerator.project_dir, accelerator.logging_dir) == (str(tmp_path / "mine"), "logs")


def test_tensorboard_without_a_directory_says_so_in_accelerates_words():
    with pytest.raises(ValueError, match=r"Logging with `tensorboard` requires a `logging_dir`"):
        Accelerator(log_with="tensorboard")


# -- state hooks ---------------------------------------------------------------------------


def test_save_and_load_hooks_see_the_models_and_write_into_the_checkpoint(tmp_path):
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(*_components()[:2])
    calls = []

    def save_config(models, weights, output_dir):
        calls.append(("save", models[0] is model, sorted(weights[0]), output_dir))
        weights[0]["bias"] = torch.full_like(weights[0]["bias"], 7.0)  # what is written
        with open(os.path.join(output_dir, "data.json"), "w") as file:
            json.dump({"class_name": type(models[0]).__name__}, file)

    def load_config(models, input_dir):
        with open(os.path.join(input_dir, "data.json")) as file:
            models[0].class_name = json.load(file)["class_name"]
        calls.append(("load", input_dir))

    save_hook = accelerator.register_save_state_pre_hook(save_config)
    load_hook = accelerator.register_load_state_pre_hook(load_config)
    target = accelerator.save_state(tmp_path / "one")
    kind, same_model, keys, written_into = calls[0]
    assert (kind, same_model, keys) == ("save", True, ["bias", "weight"])
    assert written_into != target  # the hidden directory, committed with the rest
    assert (tmp_path / "one" / "data.json").is_file()
    assert "data.json" in json.loads((tmp_path / "one" / "checkpoint.json").read_text())["files"]
    accelerator.load_state(target)
    assert calls[1] == ("load", target) and model.class_name == "Linear"
    assert torch.equal(model.bias.detach(), torch.full((2,), 7.0))

    save_hook.remove()
    load_hook.remove()
    accelerator.save_state(tmp_path / "two")
    accelerator.load_state(tmp_path / "two")
    assert len(calls) == 2 and not (tmp_path / "two" / "data.json").exists()


def test_a_save_hook_that_removes_weights_is_refused_and_nothing_is_saved(tmp_path):
    accelerator = Accelerator()
    accelerator.prepare(*_components()[:2])
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: weights.pop())
    with pytest.raises(CheckpointError, match="left 0 of the 1 models' weights"):
        accelerator.save_state(tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []


# -- prepared objects ----------------------------------------------------------------------


def test_prepared_objects_are_listed_marked_and_a_model_is_prepared_once():
    accelerator = Accelerator()
    model, optimizer, scheduler, loader = accelerator.prepare(*_components())
    plain = [1, 2, 3]
    assert accelerator.prepare(plain) is plain and not hasattr(plain, "_is_accelerate_prepared")
    assert accelerator._models == [model] and accelerator._optimizers == [optimizer]
    assert accelerator._schedulers == [scheduler] and accelerator._dataloaders == [loader]
    for obj in (model, optimizer, scheduler, loader):
        assert obj._is_accelerate_prepared is True
    assert accelerator.prepare_model(model) is model and accelerator._models == [model]
    accelerator.free_memory()
    assert accelerator._models == accelerator._dataloaders == []


def test_unwrap_model_keeps_torch_compile_only_when_asked():
    # Accelerate keeps the compiled wrapper by default; here the user's own module comes
    # back by default (its state_dict has no `_orig_mod.` prefix), as the README says.
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(model))
    assert accelerator.unwrap_model(compiled) is model
    assert accelerator.unwrap_model(compiled, keep_torch_compile=False) is model
    kept = accelerator.unwrap_model(compiled, keep_torch_compile=True)
    assert kept._orig_mod is model and kept is not compiled
    assert isinstance(compiled._orig_mod, torch.nn.DataParallel)  # the given one is unchanged
    plain_compiled = torch.compile(model)
    assert accelerator.unwrap_model(plain_compiled, keep_torch_compile=True) is plain_compiled


# -- shared states ---------------------------------------------------------------------------


def test_a_gradient_state_made_by_user_code_is_the_accelerators():
    accelerator = Accelerator()
    state = GradientState()
    assert state.num_steps == 1
    accelerator.gradient_accumulation_steps = 4
    assert state.num_steps == 4
    accelerator.sync_gradients = False
    assert state.sync_gradients is False
    assert GradientState._shared_state["num_steps"] == 4
    Accelerator(gradient_accumulation_steps=2)
    assert state.num_steps == 2  # a new Accelerator sets its settings on the shared state
    GradientState._reset_state()
    assert GradientState().num_steps == 1 and GradientState().sync_gradients is True


def test_a_pickled_accelerator_keeps_its_own_gradient_state():
    accelerator = Accelerator(gradient_accumulation_steps=3)
    copy = pickle.loads(pickle.dumps(accelerator))
    assert copy.gradient_state.num_steps == 3
    copy.gradient_accumulation_steps = 5
    assert GradientState().num_steps == 3


@pytest.mark.parametrize("kind", [PartialState, AcceleratorState])
def test_a_state_used_after_a_reset_raises_accelerate_s_attribute_errors(kind):
    state = kind()
    kind._reset_state()
    with pytest.raises(AttributeError) as raised:
        state.someotherthing  # noqa: B018
    # A name the state never had: Python's own wording.
    assert str(raised.value) == f"'{kind.__name__}' object has no attribute 'someotherthing'"
    with pytest.raises(AttributeError) as raised:
        state.process_index  # noqa: B018
    # What the reset took away: Accelerate's wording, which its test scripts match on.
    message = str(raised.value)
    assert message.startswith(f"`{kind.__name__}` object has no attribute `process_index`")
    assert f"This happens if `{kind.__name__}._reset_state()`" in message


def test_an_optimizer_marked_overflowed_holds_its_schedulers_back():
    # Accelerate's AcceleratedOptimizer keeps the skip in `_is_overflow`, which
    # `step_was_skipped` reads; code (Accelerate's scheduler tests) sets it directly.
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    optimizer._is_overflow = False
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9
    optimizer._is_overflow = True
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    scheduler.step()
    assert scheduler.get_last_lr()[0] == 0.9
