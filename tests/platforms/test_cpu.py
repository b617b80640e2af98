"""The CPU platform's two halves: what the kernel asks and what a worker asks."""

from __future__ import annotations

import pytest
import torch

from notebook_accel.platforms import PLATFORMS, CpuPlatform, DistributedType, Hardware
from notebook_accel.platforms.collectives import Collectives

LAPTOP = Hardware(cpu_cores=8, ram_bytes=16 << 30)
ONE_CORE = Hardware(cpu_cores=1)


def test_kernel_half_counts_cores_and_defaults_to_two_workers():
    cpu = CpuPlatform()
    assert cpu.device_count(LAPTOP) == 8
    assert cpu.default_num_processes(LAPTOP) == 2
    assert cpu.default_num_processes(ONE_CORE) == 1
    assert cpu.offered(ONE_CORE) and cpu.oversubscription_allowed()
    assert cpu.processes_for(LAPTOP, devices=[], asked=5) == 5
    assert cpu.worker_processes(3, LAPTOP) == 3
    assert cpu.worker_environment(0, None) == {}
    cpu.check_available(LAPTOP)
    cpu.check_parent_is_clean()


@pytest.mark.parametrize("precision", ["no", "fp16", "bf16"])
def test_every_precision_but_fp8_runs_on_cpu(precision):
    assert CpuPlatform().precision_problem(precision, LAPTOP) is None
    CpuPlatform().check_precision(precision, LAPTOP)


def test_fp8_is_refused_with_the_one_message():
    with pytest.raises(ValueError) as refused:
        CpuPlatform().check_precision("fp8", LAPTOP)
    assert str(refused.value) == (
        "mixed_precision='fp8' cannot run here: "
        + CpuPlatform().precision_problem("fp8", LAPTOP)
        + "."
    )


def test_worker_half_reads_its_place_from_the_environment(monkeypatch):
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    cpu = PLATFORMS["cpu"]
    assert cpu.placement() == (3, 4, 1, 2)
    assert cpu.device(1) == torch.device("cpu")
    assert type(cpu.collectives()) is Collectives
    assert cpu.ddp_kwargs(torch.device("cpu")) == {}
    assert cpu.distributed_type is DistributedType.MULTI_CPU and cpu.wraps_model_in_ddp
    assert cpu.process_hardware().cpu_cores >= 1


def test_outside_any_launch_a_process_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert PLATFORMS["cpu"].placement() == (0, 1, 0, 1)


def test_save_writes_what_torch_load_reads(tmp_path):
    PLATFORMS["cpu"].save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.ones(2))
