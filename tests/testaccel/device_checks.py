"""The testaccel device type and its testccl backend: devices, copies, kernels, random
numbers, autocast, memory statistics, and real two-process collectives, DDP and FSDP2.

Run by test_testaccel.py in a pytest process of its own: importing the device makes
it the accelerator of the importing process for good."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import testaccel

TESTS = Path(__file__).resolve().parent.parent
DEVICES = int(os.environ.get(testaccel.ENV_DEVICES, "4"))


# torch.accelerator answers for the device torch was built for first: CUDA on a CUDA
# build (a GPU machine), the PrivateUse1 device on a CPU build. Where it is ours, its
# device-generic API must route to it.
ROUTED = torch.version.cuda is None and torch.version.hip is None


def accel(index: int) -> torch.device:
    return torch.device(testaccel.DEVICE_TYPE, index)


@pytest.mark.timeout(60)
def test_device_count_and_accelerator():
    expected = "testaccel" if ROUTED else "cuda"
    assert torch.accelerator.current_accelerator() == torch.device(expected)
    if ROUTED:
        assert torch.accelerator.is_available()
        assert torch.accelerator.device_count() == DEVICES
    assert torch.testaccel.device_count() == DEVICES
    assert torch.testaccel.is_available()
    assert torch.testaccel.get_device_name() == "Test accelerator"
    properties = torch.testaccel.get_device_properties(1)
    assert properties.name == "Test accelerator"
    assert properties.total_memory > 0


@pytest.mark.timeout(60)
def test_tensors_live_on_each_device():
    for index in range(DEVICES):
        tensor = torch.empty(3, device=f"testaccel:{index}")
        assert tensor.device == accel(index)
        assert tensor.is_testaccel
        assert (tensor.fill_(index) + 1).device == accel(index)
    assert torch.ones(2).testaccel(1).device == accel(1)


@pytest.mark.timeout(60)
def test_current_device_and_context():
    before = torch.testaccel.current_device()
    with torch.testaccel.device(2):
        assert torch.testaccel.current_device() == 2
        assert torch.empty(1, device="testaccel").device == accel(2)
    assert torch.testaccel.current_device() == before


@pytest.mark.timeout(60)
def test_copies_between_devices_and_cpu():
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    on_one = host.to(accel(1))
    on_last = on_one.to(accel(DEVICES - 1))
    assert on_last.device == accel(DEVICES - 1)
    assert torch.equal(on_last.cpu(), host)
    # Strided, converting and broadcasting copies.
    assert torch.equal(on_one.t().cpu(), host.t())
    assert torch.equal(on_one.to(torch.float64).cpu(), host.double())
    target = torch.zeros(3, 4, device=accel(2))
    target.copy_(on_one[0])
    assert torch.equal(target.cpu(), host[0].expand(3, 4))
    assert on_one[1, 2].item() == 6.0


@pytest.mark.timeout(60)
def test_ops_through_the_fallback_equal_cpu():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 6, generator=generator), torch.randn(6, 3, generator=generator)
    da, db = a.to(accel(3)), b.to(accel(3))
    for got, expected in [
        (da @ db, a @ b),
        (torch.softmax(da, dim=1), torch.softmax(a, dim=1)),
        (da.sum(0), a.sum(0)),
        (torch.cat([da, da]), torch.cat([a, a])),
        (da[1:, ::2].contiguous(), a[1:, ::2].contiguous()),
        (F.relu(da).view(-1), F.relu(a).view(-1)),
    ]:
        assert got.device == accel(3)
        assert torch.equal(got.cpu(), expected)
    x = da.clone().requires_grad_()
    (x * x).sum().backward()
    assert x.grad.device == accel(3)
    assert torch.equal(x.grad.cpu(), 2 * a)


@pytest.mark.timeout(60)
def test_random_numbers_per_device_and_state_restore():
    torch.manual_seed(1234)
    first = torch.randn(4, device=accel(1)).cpu()
    torch.manual_seed(1234)
    assert torch.equal(torch.randn(4, device=accel(1)).cpu(), first)

    torch.testaccel.manual_seed_all(7)
    state = torch.testaccel.get_rng_state(device=1)
    other = torch.testaccel.get_rng_state(device=2)
    drawn = torch.rand(5, device=accel(1)).cpu()
    torch.randn(3, device=accel(2))  # another device's stream of numbers moves on
    torch.testaccel.set_rng_state(state, device=1)
    assert torch.equal(torch.rand(5, device=accel(1)).cpu(), drawn)
    assert not torch.equal(torch.testaccel.get_rng_state(device=2), other)

    states = torch.testaccel.get_rng_state_all()
    dropped = F.dropout(torch.ones(64, device=accel(0)), p=0.5).cpu()
    torch.testaccel.set_rng_state_all(states)
    assert torch.equal(F.dropout(torch.ones(64, device=accel(0)), p=0.5).cpu(), dropped)

    generator = torch.Generator(device=accel(2)).manual_seed(3)
    assert generator.device == accel(2)
    drawn = torch.randn(3, device=accel(2), generator=generator).cpu()
    generator.manual_seed(3)
    assert torch.equal(torch.randn(3, device=accel(2), generator=generator).cpu(), drawn)


@pytest.mark.timeout(60)
def test_autocast_bfloat16_only():
    assert torch.testaccel.get_amp_supported_dtype() == [torch.bfloat16, torch.float32]
    assert torch.float16 not in torch.testaccel.get_amp_supported_dtype()
    assert torch.testaccel.is_bf16_supported()
    linear = torch.nn.Linear(4, 3).to(accel(1))
    x = torch.randn(2, 4, device=accel(1))
    with torch.autocast("testaccel", dtype=torch.bfloat16):
        assert linear(x).dtype == torch.bfloat16
        assert (x @ x.t()).dtype == torch.bfloat16
        assert torch.softmax(x, dim=1).dtype == torch.float32
    assert linear(x).dtype == torch.float32


@pytest.mark.timeout(60)
def test_memory_statistics_per_device():
    torch.testaccel.reset_peak_memory_stats(2)
    before_2 = torch.testaccel.memory_allocated(2)
    before_0 = torch.testaccel.memory_allocated(0)
    block = torch.empty(1 << 20, dtype=torch.uint8, device=accel(2))
    assert torch.testaccel.memory_allocated(2) == before_2 + (1 << 20)
    assert torch.testaccel.memory_allocated(0) == before_0
    assert torch.testaccel.max_memory_allocated(2) >= before_2 + (1 << 20)
    free, total = torch.testaccel.mem_get_info(2)
    assert free == total - torch.testaccel.memory_reserved(2)
    assert torch.testaccel.memory_stats(2)["allocated_bytes.all.current"] >= 1 << 20
    if ROUTED:
        assert torch.accelerator.memory_allocated(2) == before_2 + (1 << 20)
        assert torch.accelerator.max_memory_allocated(2) >= before_2 + (1 << 20)
        assert (free, total) == torch.accelerator.get_memory_info(2)
        assert torch.accelerator.memory_stats(2)["allocated_bytes.all.current"] >= 1 << 20
    del block
    assert torch.testaccel.memory_allocated(2) == before_2
    reset = (
        torch.accelerator.reset_peak_memory_stats
        if ROUTED
        else torch.testaccel.reset_peak_memory_stats
    )
    reset(2)
    assert torch.testaccel.max_memory_allocated(2) == before_2
    if ROUTED:
        torch.accelerator.empty_cache()
    torch.testaccel.empty_cache()


@pytest.mark.timeout(60)
def test_streams_and_events_complete_at_once():
    stream = torch.testaccel.Stream(1)
    with torch.testaccel.stream(stream):
        assert torch.testaccel.current_stream(1) == stream
    assert torch.testaccel.current_stream(1) == torch.testaccel.default_stream(1)
    event = torch.testaccel.Event()
    event.record()
    event.synchronize()
    assert event.query()
    torch.testaccel.synchronize()
    assert torch.ones(4).pin_memory().is_pinned()


@pytest.mark.timeout(60)
def test_build_is_cached_outside_the_checkout():
    library = testaccel.build()
    assert library.exists()
    assert not library.resolve().is_relative_to(TESTS.parent)
    assert testaccel.build() == library


@pytest.mark.timeout(90)
def test_two_processes_collectives_ddp_and_fsdp2(tmp_path):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    world = 2
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testaccel.dist_check",
                str(rank),
                str(world),
                str(tmp_path / "rendezvous"),
                str(tmp_path / f"rank{rank}.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=80)[0])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for rank, worker in enumerate(workers):
        assert worker.returncode == 0, f"rank {rank}:\n{outputs[rank][-4000:]}"

    for rank in range(world):
        found = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert found["backend"] == testaccel.BACKEND
        device, reduced = found["all_reduce"]
        assert device == f"testaccel:{rank}"
        assert torch.equal(reduced, torch.full((3,), 3.0))
        assert torch.equal(found["all_gather_into_tensor"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert torch.equal(
            found["reduce_scatter_tensor"], torch.arange(4.0)[2 * rank : 2 * rank + 2] * 2
        )
        assert [t.item() for t in found["all_gather"]] == [0.0, 1.0]
        assert found["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert found["broadcast_object_list"] == "from 0"
        for name in ("ddp_accel", "ddp_accel_no_ids"):
            for got, expected in zip(found[name], found["ddp_cpu"], strict=True):
                assert torch.equal(got, expected), name
        for got, expected in zip(found["fsdp"], found["fsdp_expected"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
