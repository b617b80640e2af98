"""LocalSGD, accelerator.profile() and DDP communication hooks on 2 CPU workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from notebook_accel import notebook_launcher
from notebook_accel.config.kwargs import DDPCommunicationHookType, DistributedDataParallelKwargs


def _local_sgd() -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.accelerator.local_sgd import LocalSGD

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    same, mean_before = [], []
    with LocalSGD(accelerator, model, local_sgd_steps=2) as local_sgd:
        for step in range(4):
            x = torch.full((2, 4), float(rank + step + 1))
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            weights = accelerator.unwrap_model(model).weight.detach().clone()
            mean_before.append(accelerator.reduce(weights, "mean"))
            local_sgd.step()
            after = accelerator.unwrap_model(model).weight.detach()
            gathered = accelerator.gather(after[None])
            same.append(bool(torch.equal(gathered[0], gathered[1])))
            if step % 2 == 1:  # averaged: every rank holds the mean of what they had
                assert torch.equal(after, mean_before[-1])
    return {"same": same}


def test_local_sgd_trains_apart_and_averages_every_local_sgd_steps():
    result = notebook_launcher(_local_sgd, num_processes=2, backend="cpu", timeout=100)
    assert result == {"same": [False, True, False, True]}


def _profile(folder: str) -> list:
    from notebook_accel import Accelerator, ProfileKwargs

    accelerator = Accelerator(
        kwargs_handlers=[ProfileKwargs(record_shapes=True, output_trace_dir=folder)]
    )
    with accelerator.profile() as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    return sorted({event.key for event in prof.key_averages()})


def test_profile_writes_a_chrome_trace_per_rank(tmp_path):
    keys = notebook_launcher(
        _profile, args=(str(tmp_path),), num_processes=2, backend="cpu", timeout=100
    )
    assert "aten::matmul" in keys
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"profile_{rank}.json").read_text())
        assert any(e.get("name") == "aten::matmul" for e in trace["traceEvents"])


def _hooked(hook: str, wrapper: str) -> dict:
    from notebook_accel import Accelerator

    handler = DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=wrapper)
    accelerator = Accelerator(kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    x = torch.full((4, 8), float(accelerator.process_index + 1))
    accelerator.backward(model(x).sum())
    grad = model.module.weight.grad
    gathered = accelerator.gather(grad[None])
    return {
        "hook": model._get_ddp_logging_data().get("comm_hook").rpartition(".")[2],
        "synced": bool(torch.equal(gathered[0], gathered[1])),
    }


@pytest.mark.parametrize(
    ("hook", "wrapper", "registered"),
    [
        ("fp16", "no", "fp16_compress_hook"),
        ("power_sgd", "no", "powerSGD_hook"),
        ("batched_power_sgd", "no", "batched_powerSGD_hook"),
        ("power_sgd", "fp16", "fp16_compress_wrapper_hook"),
        ("batched_power_sgd", "fp16", "fp16_compress_wrapper_hook"),
    ],
)
def test_ddp_communication_hooks_are_torchs_and_keep_gradients_in_sync(hook, wrapper, registered):
    result = notebook_launcher(
        _hooked, args=(hook, wrapper), num_processes=2, backend="cpu", timeout=100
    )
    assert result == {"hook": registered, "synced": True}


def _bf16_hook() -> None:
    from notebook_accel import Accelerator

    Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="bf16")])


def test_a_bf16_hook_on_cpu_workers_is_refused_with_the_way_out():
    # torch's bf16 hooks need NCCL; on gloo they would fail at registration
    from notebook_accel import WorkerError

    with pytest.raises(WorkerError, match="bf16 gradient compression needs GPU processes"):
        notebook_launcher(_bf16_hook, num_processes=2, backend="cpu", timeout=100)


def test_profile_options_are_checked():
    from notebook_accel import ProfileKwargs

    with pytest.raises(ValueError, match="activities has 'gpu'; choose among cpu, cuda"):
        ProfileKwargs(activities=["gpu"])
    with pytest.raises(ValueError, match="schedule_option has 'wiat'"):
        ProfileKwargs(schedule_option={"wiat": 1})


def test_hook_options_are_checked_before_anything_starts():
    assert (
        DistributedDataParallelKwargs(comm_hook="fp16").comm_hook is DDPCommunicationHookType.FP16
    )
    with pytest.raises(ValueError, match="comm_hook='zip' must be one of no, fp16, bf16"):
        DistributedDataParallelKwargs(comm_hook="zip")
    with pytest.raises(ValueError, match="wraps a PowerSGD hook"):
        DistributedDataParallelKwargs(comm_hook="fp16", comm_wrapper="bf16")
    with pytest.raises(ValueError, match="comm_wrapper='power_sgd' must be one of no, fp16, bf16"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
    kwargs = DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 2}, static_graph=True
    )
    assert kwargs.to_kwargs() == {"static_graph": True}  # what DDP itself takes


def test_probes_answer_without_importing_the_packages():
    code = (
        "import sys, notebook_accel.utils as u\n"
        "answers = {n: getattr(u, n)() for n in u._PROBES}\n"
        "assert all(isinstance(a, bool) for a in answers.values()), answers\n"
        "heavy = [m for m in ('tensorboard', 'datasets', 'schedulefree', 'transformers',"
        " 'torch_xla', 'deepspeed', 'wandb') if m in sys.modules]\n"
        "print(answers['is_tensorboard_available'], answers['is_datasets_available'],"
        " answers['is_deepspeed_available'], answers['is_xpu_available'], heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    )
    assert done.stdout.split() == ["True", "True", "False", "False", "[]"]
