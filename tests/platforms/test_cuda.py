"""The CUDA platform's two halves against described machines (no GPU needed)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from notebook_accel.platforms import CudaPlatform, GpuInfo, Hardware, LaunchRefused, cuda

TWO_T4 = Hardware(
    gpus=(GpuInfo(0, "Tesla T4", 16 << 30, (7, 5)), GpuInfo(1, "Tesla T4", 16 << 30, (7, 5))),
    cpu_cores=4,
)
ONE_H100 = Hardware(gpus=(GpuInfo(0, "H100", 80 << 30, (9, 0)),), cpu_cores=8)
CPU_ONLY = Hardware(cpu_cores=2)


def test_kernel_half_counts_gpus_and_starts_one_worker_each():
    gpu = CudaPlatform()
    assert gpu.device_count(TWO_T4) == 2 and gpu.default_num_processes(TWO_T4) == 2
    assert gpu.offered(TWO_T4) and not gpu.offered(CPU_ONLY)
    assert gpu.processes_for(TWO_T4, devices=[1], asked=8) == 1
    assert not gpu.oversubscription_allowed() and gpu.chooses_devices


def test_bf16_and_fp8_follow_the_oldest_gpus_capability(monkeypatch):
    gpu = CudaPlatform()
    assert "bf16 needs compute capability 8.0" in gpu.precision_problem("bf16", TWO_T4)
    assert "Tesla T4 has 7.5" in gpu.precision_problem("bf16", TWO_T4)
    assert gpu.precision_problem("fp16", TWO_T4) is None
    assert gpu.precision_problem("bf16", ONE_H100) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "torchao" in gpu.precision_problem("fp8", ONE_H100)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert gpu.precision_problem("fp8", ONE_H100) is None


def test_worker_sees_only_its_chosen_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaPlatform().worker_environment(0, [1, 3]) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert CudaPlatform().worker_environment(0, None) == {}
    # Indices count the GPUs this process sees, so they index an existing narrowing.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert CudaPlatform().worker_environment(0, [2]) == {"CUDA_VISIBLE_DEVICES": "6"}


def test_no_forking_once_cuda_is_initialised_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchRefused, match="a forked worker cannot use a GPU"):
        CudaPlatform().check_parent_is_clean()
    assert CudaPlatform().fresh_start_problem() is None  # fresh interpreters still can
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: False)
    CudaPlatform().check_parent_is_clean()


def test_worker_half_checks_precision_on_the_device_it_uses(monkeypatch):
    """Accelerator() asks process_hardware(): the same check as the launcher's."""
    properties = SimpleNamespace(name="Tesla T4", total_memory=16 << 30, major=7, minor=5)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    seen = CudaPlatform().process_hardware()
    assert seen.gpus == (GpuInfo(0, "Tesla T4", 16 << 30, (7, 5)),)
    launcher_says = CudaPlatform().precision_problem("bf16", TWO_T4)
    with pytest.raises(ValueError) as worker_says:
        CudaPlatform().check_precision("bf16", seen)
    assert launcher_says in str(worker_says.value)


def test_ddp_is_told_the_device():
    device = torch.device("cuda", 1)
    assert CudaPlatform().ddp_kwargs(device) == {"device_ids": [1], "output_device": 1}


def test_device_beyond_the_visible_gpus_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="at most one process per GPU"):
        CudaPlatform().device(1)
