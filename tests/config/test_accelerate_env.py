"""Accelerate's ACCELERATE_* variables reach the Accelerator where Accelerate reads them,
below an argument given in code and below a launch of ours."""

from __future__ import annotations

import pytest
import torch

import notebook_accel.training.state as state_module
from notebook_accel import Accelerator, GradientState, LaunchSettings, PartialState
from notebook_accel.config import accelerate_env
from notebook_accel.config.kwargs import TorchDynamoPlugin
from notebook_accel.state import AcceleratorState
from notebook_accel.training import ops

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LaunchSettings().to_env())
ACCELERATE_VARS = (
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_TORCH_DEVICE",
    "ACCELERATE_DEBUG_MODE",
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_MODE",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "ACCELERATE_DYNAMO_USE_DYNAMIC",
)


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    for name in (*LAUNCH_VARS, *ACCELERATE_VARS):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    ops.check_shapes(False)  # what ACCELERATE_DEBUG_MODE turned on
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_flags_are_spelled_as_accelerate_spells_them():
    for value in ("1", "true", "YES", "on"):
        assert accelerate_env.flag("X", environ={"X": value})
    for value in ("0", "false", "No", "off"):
        assert not accelerate_env.flag("X", environ={"X": value})
    assert not accelerate_env.flag("X", environ={})
    with pytest.raises(ValueError, match="X='maybe' is neither true nor false"):
        accelerate_env.flag("X", environ={"X": "maybe"})
    with pytest.raises(ValueError, match="not a whole number"):
        accelerate_env.gradient_accumulation_steps({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "x"})


def test_precision_and_accumulation_come_from_the_variables_in_a_plain_process(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    accelerator = Accelerator()
    assert (accelerator.mixed_precision, accelerator.gradient_accumulation_steps) == ("bf16", 3)
    AcceleratorState._reset_state(True)
    explicit = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    assert (explicit.mixed_precision, explicit.gradient_accumulation_steps) == ("no", 2)


def test_a_launch_of_ours_wins_over_the_variables(monkeypatch):
    for name, value in LaunchSettings("cpu", "no", 1).to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    accelerator = Accelerator()
    assert (accelerator.mixed_precision, accelerator.gradient_accumulation_steps) == ("no", 1)


def test_use_cpu_skips_asking_the_hardware(monkeypatch):
    def asked():
        raise AssertionError("the hardware was asked although ACCELERATE_USE_CPU is set")

    monkeypatch.setattr(state_module, "platform_for_process", asked)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "yes")
    assert PartialState().platform_name == "cpu"
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "no")
    with pytest.raises(AssertionError, match="the hardware was asked"):
        PartialState()


def test_torch_device_names_the_device_below_a_launch_of_ours(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "yes")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu:64")
    assert str(Accelerator().device) == "cpu:64"
    AcceleratorState._reset_state(True)
    for name, value in LaunchSettings("cpu", "no", 1).to_env().items():
        monkeypatch.setenv(name, value)
    assert str(Accelerator().device) == "cpu"


def test_debug_mode_turns_on_the_shape_checks(monkeypatch):
    assert PartialState().debug is False
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    assert PartialState().debug is True


def test_the_dynamo_variables_fill_the_plugins_unset_fields(monkeypatch):
    assert TorchDynamoPlugin().to_kwargs() == {"backend": "no"}
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "reduce-overhead")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "false")
    assert TorchDynamoPlugin().to_kwargs() == {
        "backend": "aot_eager",
        "mode": "reduce-overhead",
        "fullgraph": True,
        "dynamic": False,
    }
    assert TorchDynamoPlugin(backend="eager", mode="default").to_kwargs() == {
        "backend": "eager",
        "fullgraph": True,
        "dynamic": False,
    }


def test_accelerator_compiles_with_the_backend_accelerate_launch_set(monkeypatch):
    from torch._dynamo.eval_frame import OptimizedModule

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    assert isinstance(Accelerator().prepare(torch.nn.Linear(2, 2)), OptimizedModule)
    plain = Accelerator(dynamo_backend="no").prepare(torch.nn.Linear(2, 2))
    assert not isinstance(plain, OptimizedModule)
