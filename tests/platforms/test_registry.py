"""One registry: the launcher, the panel, the command line and the worker find the same class."""

from __future__ import annotations

import pytest

from notebook_accel import Accelerator, platforms
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.platforms import PLATFORMS, GpuInfo, Hardware, XlaInfo
from notebook_accel.ui.panel import PanelChoices

T4 = Hardware(gpus=(GpuInfo(0, "Tesla T4", 16 << 30, (7, 5)),), cpu_cores=4)
TPU = Hardware(tpu_cores=4, xla=XlaInfo("TPU", 4, 1), cpu_cores=4)
CPU_ONLY = Hardware(cpu_cores=2)


def train():
    raise AssertionError("never runs")


def test_every_platform_is_registered_by_its_name():
    assert {"cpu", "cuda", "xla"} <= set(PLATFORMS)
    assert list(PLATFORMS)[-1] == "cpu"  # a device type named later comes before the CPU
    for name, platform in PLATFORMS.items():
        assert platform.name == name
    assert all(PLATFORMS[name].process_group_backend for name in ("cpu", "cuda", "xla"))


def test_offered_platforms_put_the_machine_s_accelerator_first():
    assert platforms.offered_platforms(T4) == ["cuda", "cpu"]
    assert platforms.offered_platforms(TPU) == ["xla", "cpu"]
    assert platforms.offered_platforms(CPU_ONLY) == ["cpu"]
    for hardware in (T4, TPU, CPU_ONLY):
        assert platforms.default_platform(hardware).name == hardware.accelerator


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="backend='tpuu' is no device type torch knows") as e:
        platforms.platform_named("tpuu")
    for name in ("cuda", "xla", "cpu", "xpu", "npu", "mlu", "hpu", "musa", "mps"):
        assert f" {name}," in str(e.value) or f" {name} " in str(e.value)


def test_launcher_panel_and_accelerator_give_the_same_precision_message():
    """One check, one message, whoever asks: here fp8 on a CPU-only machine."""
    problem = PLATFORMS["cpu"].precision_problem("fp8", CPU_ONLY)
    with pytest.raises(ValueError) as launcher:
        plan_launch(function=train, num_processes=2, mixed_precision="fp8", hardware=CPU_ONLY)
    with pytest.raises(ValueError) as accelerator:
        Accelerator(cpu=True, mixed_precision="fp8")
    panel = PanelChoices.for_hardware(CPU_ONLY).precision_problems()["fp8"]
    assert panel == problem
    assert str(launcher.value) == str(accelerator.value)
    assert problem in str(launcher.value)


def test_the_plan_carries_the_platform_the_worker_looks_up():
    plan = plan_launch(function=train, num_processes=2, hardware=CPU_ONLY)
    assert plan.settings.backend == "cpu" and PLATFORMS[plan.settings.backend] is plan.platform
    assert plan.settings.to_env()["NOTEBOOK_ACCEL_BACKEND"] == "cpu"
