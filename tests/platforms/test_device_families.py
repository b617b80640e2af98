"""Every accelerator family torch reports goes through one platform.

No XPU, NPU, MLU, HPU, MUSA, Mac or ROCm machine is at hand: here the probes
(platforms/accelerator.py's `torch_accelerator` and `accelerator_device_count`; for
ROCm, torch.version.hip and `is_rocm_available`) answer as such a machine's
torch does, and the launcher, the panel, the command line's report and
`Accelerator()` choose through the same code that runs real workers on the
test accelerator (tests/platforms/test_test_accelerator.py).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from notebook_accel.launch.preflight import plan_launch
from notebook_accel.platforms import (
    AcceleratorPlatform,
    CudaPlatform,
    DistributedType,
    GpuInfo,
    Hardware,
    MpsPlatform,
    accelerator,
    detect_hardware,
    platform_for_process,
    platform_named,
    probes,
)
from notebook_accel.platforms.accelerator import ENV_DEVICE_INDICES
from notebook_accel.ui.panel import PanelChoices, hardware_summary

pytestmark = pytest.mark.timeout(60)


def train(lr=0.1):
    raise AssertionError("never runs: these tests only plan")


def answer_as(monkeypatch, device_type: str | None, count: int) -> Hardware:
    """Make this process's probes answer as a machine with `count` `device_type` devices."""
    monkeypatch.setattr(accelerator, "torch_accelerator", lambda: device_type)
    monkeypatch.setattr(accelerator, "accelerator_device_count", lambda kind: count)
    return detect_hardware()


FAMILIES = [
    # device type, backend, Accelerate's distributed type, what messages call it
    ("xpu", "xccl", DistributedType.MULTI_XPU, "Intel XPU"),
    ("npu", "hccl", DistributedType.MULTI_NPU, "Ascend NPU"),
    ("mlu", "cncl", DistributedType.MULTI_MLU, "Cambricon MLU"),
    ("hpu", "hccl", DistributedType.MULTI_HPU, "Gaudi HPU"),
    ("musa", "mccl", DistributedType.MULTI_MUSA, "Moore Threads MUSA"),
]


@pytest.mark.parametrize(("device_type", "backend", "distributed", "title"), FAMILIES)
def test_a_family_machine_launches_one_worker_per_device_on_torch_s_backend(
    monkeypatch, device_type, backend, distributed, title
):
    hardware = answer_as(monkeypatch, device_type, 4)
    assert hardware.accelerator == device_type and hardware.accelerators.count == 4
    plan = plan_launch(function=train, hardware=hardware)
    platform = plan.platform
    assert type(platform) is AcceleratorPlatform and platform.name == device_type
    assert plan.local_world_size == 4 and plan.settings.backend == device_type
    assert platform.process_group_backend == backend
    assert platform.distributed_type == distributed
    # Chosen devices travel to the workers by index: local rank r takes the r-th.
    chosen = plan_launch(function=train, hardware=hardware, devices=[1, 3])
    assert chosen.local_world_size == 2
    assert platform.worker_environment(0, chosen.devices)[ENV_DEVICE_INDICES] == "1,3"
    with pytest.raises(ValueError, match=f"num_processes=5 asks for one {title} per worker"):
        plan_launch(function=train, hardware=hardware, num_processes=5)
    # The same platform answers for a process outside any launch (Accelerator()).
    assert platform_for_process() is platform
    assert PanelChoices.for_hardware(hardware).backends() == [device_type, "cpu"]
    assert f"{device_type}: 4 device(s)" in hardware_summary(hardware)


@pytest.mark.parametrize(("device_type", "backend", "distributed", "title"), FAMILIES)
def test_fp8_is_refused_on_every_family_with_what_to_use(
    monkeypatch, device_type, backend, distributed, title
):
    hardware = answer_as(monkeypatch, device_type, 2)
    plan_launch(function=train, hardware=hardware, mixed_precision="bf16")
    with pytest.raises(ValueError, match=f"fp8 training needs a CUDA GPU.*on {title} devices"):
        plan_launch(function=train, hardware=hardware, mixed_precision="fp8")


def test_xpu_touched_by_the_kernel_starts_workers_from_a_clean_process(monkeypatch):
    hardware = answer_as(monkeypatch, "xpu", 2)
    monkeypatch.delenv("NOTEBOOK_ACCEL_START_METHOD", raising=False)
    assert plan_launch(function=train, hardware=hardware).start_method == "fork"
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: True)
    plan = plan_launch(function=train, hardware=hardware)
    assert plan.start_method == "forkserver"
    assert "Intel XPU is already initialised in this process" in plan.fresh_start_reason


def test_rocm_gpus_run_on_the_cuda_platform_and_name_hip_when_it_started(monkeypatch):
    monkeypatch.delenv("NOTEBOOK_ACCEL_START_METHOD", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(probes, "is_rocm_available", lambda: True)
    two_mi300 = Hardware(gpus=(GpuInfo(0, "MI300X"), GpuInfo(1, "MI300X")), cpu_cores=8)
    plan = plan_launch(function=train, hardware=two_mi300)
    assert isinstance(plan.platform, CudaPlatform) and isinstance(
        plan.platform, AcceleratorPlatform
    )
    assert plan.platform.process_group_backend == "nccl"  # RCCL answers to that name
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    plan = plan_launch(function=train, hardware=two_mi300)
    assert plan.start_method == "forkserver"
    assert "ROCm (HIP) is already initialised" in plan.fresh_start_reason


def test_a_mac_trains_on_mps_in_the_kernel_and_refuses_more_processes(monkeypatch):
    hardware = answer_as(monkeypatch, "mps", 1)
    assert hardware.accelerator == "mps"
    plan = plan_launch(function=train, hardware=hardware)
    assert isinstance(plan.platform, MpsPlatform) and plan.in_process
    assert plan.platform.device(0) == torch.device("mps")
    with pytest.raises(ValueError, match="one process.*backend='cpu'") as refused:
        plan_launch(function=train, hardware=hardware, num_processes=2)
    assert "Pass num_processes=1" in str(refused.value)
    cpu = plan_launch(function=train, hardware=hardware, num_processes=2, backend="cpu")
    assert cpu.platform.name == "cpu" and cpu.local_world_size == 2
    plan_launch(function=train, hardware=hardware, mixed_precision="fp16")
    assert platform_for_process() is platform_named("mps")
    choices = PanelChoices.for_hardware(hardware)
    assert choices.backends() == ["mps", "cpu"] and choices.processes() == 1


def test_bf16_on_mps_needs_macos_14(monkeypatch):
    hardware = answer_as(monkeypatch, "mps", 1)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: False)
    with pytest.raises(ValueError, match="bf16 on MPS needs macOS 14"):
        plan_launch(function=train, hardware=hardware, mixed_precision="bf16")
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: True)
    plan_launch(function=train, hardware=hardware, mixed_precision="bf16")


def test_a_device_backend_on_a_machine_without_it_names_what_the_machine_offers(monkeypatch):
    hardware = answer_as(monkeypatch, None, 0)
    with pytest.raises(ValueError, match="needs Intel XPU devices, and this machine has none") as e:
        plan_launch(function=train, hardware=hardware, backend="xpu")
    assert "it offers backend='cpu'" in str(e.value)
    with pytest.raises(ValueError, match="torch-tpu runs on a TPU VM and has no CPU mode"):
        plan_launch(function=train, hardware=hardware, backend="tpu")


def test_an_unknown_device_type_is_refused_by_name_never_run_on_the_cpu(monkeypatch):
    hardware = answer_as(monkeypatch, "quantum", 2)
    assert hardware.accelerator == "quantum"
    with pytest.raises(ValueError, match="backend='quantum' is no device type torch knows"):
        plan_launch(function=train, hardware=hardware)
    with pytest.raises(ValueError, match="backend='quantum'"):
        platform_for_process()


def test_a_device_package_that_fails_to_import_is_named_and_the_cpu_stays_usable(
    monkeypatch, tmp_path
):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            raise ImportError(
                "libascendcl.so: cannot open shared object file: No such file or directory"
            )
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(accelerator, "torch_accelerator", lambda: None)
    hardware = detect_hardware()
    found = hardware.accelerators
    assert found.device_type == "npu" and found.package == "torch_npu"
    assert "torch_npu failed to import" in found.problem and "libascendcl.so" in found.problem
    assert hardware.accelerator == "cpu"
    with pytest.raises(RuntimeError, match="torch_npu failed to import.*pass backend='cpu'"):
        plan_launch(function=train, hardware=hardware, backend="npu")
    assert plan_launch(function=train, hardware=hardware, num_processes=2).platform.name == "cpu"
    assert "npu: cannot be used: its package torch_npu" in hardware_summary(hardware)
    with pytest.warns(RuntimeWarning, match="torch_npu failed to import.*Training on the CPU"):
        assert platform_for_process().name == "cpu"
