"""The XLA platform's two halves against described TPU hosts and a stand-in torch_xla."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from notebook_accel.platforms import Hardware, XlaInfo, XlaPlatform
from notebook_accel.platforms.xla import XlaCollectives

V3_8 = Hardware(tpu_cores=8, xla=XlaInfo("TPU", 4, 2, "v3-8", "kaggle"), cpu_cores=96)
XLA_CPU = Hardware(xla=XlaInfo("CPU", 1, 1), cpu_cores=2)


def test_kernel_half_runs_one_process_per_chip():
    tpu = XlaPlatform()
    assert tpu.device_count(V3_8) == 8 and tpu.default_num_processes(V3_8) == 8
    assert tpu.worker_processes(8, V3_8) == 4  # two cores per v3 chip, a thread each
    assert tpu.worker_processes(1, V3_8) == 1
    assert tpu.processes_for(V3_8, devices=[], asked=2) == 8
    assert tpu.offered(V3_8) and not tpu.offered(XLA_CPU)  # the CPU device is opt-in
    assert not tpu.single_worker_in_process and not tpu.supports_multinode


def test_the_refusal_of_too_many_workers_says_what_the_host_is():
    tpu = XlaPlatform()
    colab = Hardware(tpu_cores=1, xla=XlaInfo("TPU", 1, 1, "v5e-1", "colab", chip="v5e"))
    assert tpu.devices_summary(colab) == (
        "this Colab runtime is a TPU v5e-1 (1 chip, 1 core), so a launch trains in one "
        "worker process"
    )
    assert tpu.devices_summary(V3_8) == "this Kaggle session is a TPU v3-8 (4 chips, 2 cores each)"
    assert tpu.devices_summary(XLA_CPU) == ""  # XLA's CPU device: the count says it all


def test_fp16_is_refused_and_bf16_runs():
    tpu = XlaPlatform()
    assert tpu.precision_problem("bf16", V3_8) is None
    with pytest.raises(ValueError, match="TPUs compute in bfloat16"):
        tpu.check_precision("fp16", V3_8)


def test_workers_are_told_the_device_kind(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert XlaPlatform().worker_environment(0, None) == {"PJRT_DEVICE": "TPU"}
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert XlaPlatform().worker_environment(0, None) == {"PJRT_DEVICE": "CPU"}


@pytest.fixture
def fake_torch_xla(monkeypatch):
    """torch_xla's few entry points the worker half uses, recording the calls."""
    calls: list[str] = []
    root = types.ModuleType("torch_xla")
    root.device = lambda: torch.device("cpu")
    root.sync = lambda: calls.append("sync")
    runtime = types.ModuleType("torch_xla.runtime")
    runtime.global_ordinal, runtime.world_size = (lambda: 5), (lambda: 8)
    runtime.local_ordinal, runtime.local_device_count = (lambda: 1), (lambda: 2)
    core = types.ModuleType("torch_xla.core")
    xla_model = types.ModuleType("torch_xla.core.xla_model")
    xla_model.rendezvous = lambda tag: calls.append(f"rendezvous {tag}")
    xla_model.reduce_gradients = lambda optimizer: calls.append("reduce_gradients")
    root.runtime, root.core, core.xla_model = runtime, core, xla_model
    for name, module in {
        "torch_xla": root,
        "torch_xla.runtime": runtime,
        "torch_xla.core": core,
        "torch_xla.core.xla_model": xla_model,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_worker_half_goes_through_torch_xla(fake_torch_xla, monkeypatch):
    monkeypatch.setenv("PJRT_LOCAL_PROCESS_COUNT", "4")  # what torch_xla's initialisers set
    tpu = XlaPlatform()
    assert tpu.placement() == (5, 8, 1, 2)
    assert tpu.device(0) == torch.device("cpu")
    assert isinstance(tpu.collectives(), XlaCollectives)
    assert not tpu.wraps_model_in_ddp
    tpu.barrier()
    tpu.reduce_gradients(object())
    tpu.end_step()
    tpu.before_batch_transfer()
    # The barrier cuts the graph before the processes meet; each batch starts a new graph.
    assert fake_torch_xla == [
        "sync",
        "rendezvous notebook_accel.barrier",
        "reduce_gradients",
        "sync",
        "sync",
    ]


def test_alone_outside_a_launch_the_runtime_is_not_asked(fake_torch_xla, monkeypatch):
    """An Accelerator made in the kernel: one process on xla:0, runtime not started."""
    monkeypatch.delenv("PJRT_LOCAL_PROCESS_COUNT", raising=False)
    runtime = sys.modules["torch_xla.runtime"]
    for name in ("global_ordinal", "world_size", "local_ordinal", "local_device_count"):
        monkeypatch.setattr(runtime, name, lambda: pytest.fail("the runtime was asked"))
    monkeypatch.setattr(sys.modules["torch_xla"], "device", lambda: pytest.fail("started"))
    tpu = XlaPlatform()
    assert tpu.placement() == (0, 1, 0, 1)
    assert tpu.device(0) == torch.device("xla", 0)
    collectives = tpu.collectives()
    assert not isinstance(collectives, XlaCollectives) and collectives.world_size() == 1
