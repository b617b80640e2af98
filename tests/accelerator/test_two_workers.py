"""Real two-process gloo runs through notebook_launcher.

Equivalence: two workers on half batches reach the same weights as one process
on the whole batch (plain, with accumulation, with split_batches).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, DataLoaderConfiguration, notebook_launcher

N, FEATURES = 32, 4


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, FEATURES, generator=g), torch.randn(N, 1, generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def _reference(batch_size: int) -> list[torch.Tensor]:
    """Plain single-process SGD on consecutive batches of `batch_size`."""
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, N, batch_size):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(x[start : start + batch_size]), y[start : start + batch_size]
        )
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _train_worker(batch_size: int, split_batches: bool):
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split_batches))
    model = _model()
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(TensorDataset(*_data()), batch_size=batch_size),
    )
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    return {
        "world": acc.num_processes,
        "type": str(acc.distributed_type),
        "ddp": type(model).__name__,
        "accumulation": acc.gradient_accumulation_steps,
        "weights": [p.detach() for p in acc.unwrap_model(model).parameters()],
    }


@pytest.mark.parametrize(
    "worker_batch,split,accumulation,reference_batch",
    [
        pytest.param(4, False, 1, 8, id="plain"),
        pytest.param(4, False, 2, 16, id="accumulation"),
        pytest.param(8, True, 1, 8, id="split_batches"),
    ],
)
def test_two_workers_match_one_process(worker_batch, split, accumulation, reference_batch):
    results = notebook_launcher(
        _train_worker,
        args=(worker_batch, split),
        num_processes=2,
        gradient_accumulation_steps=accumulation,
        return_all=True,
        backend="cpu",
    )
    expected = _reference(reference_batch)
    # A different batch would give different weights: the comparison can fail.
    assert not all(torch.allclose(a, b) for a, b in zip(_reference(4), expected, strict=True))
    for result in results:
        assert result["world"] == 2 and result["type"] == "MULTI_CPU"
        assert result["ddp"] == "DistributedDataParallel"
        assert result["accumulation"] == accumulation
        for got, want in zip(result["weights"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _bf16_worker():
    acc = Accelerator()
    model = acc.prepare(_model())
    seen = []
    acc.unwrap_model(model)[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(torch.ones(2, FEATURES))
    return acc.mixed_precision, str(seen[0]), str(out.dtype)


def test_a_bf16_launch_reaches_the_accelerator_and_its_forward():
    results = notebook_launcher(
        _bf16_worker, num_processes=2, mixed_precision="bf16", return_all=True, backend="cpu"
    )
    assert results == [("bf16", "torch.bfloat16", "torch.float32")] * 2


def _overflow_worker():
    acc = Accelerator(mixed_precision="fp16")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = _data()
    history = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        loss = torch.nn.functional.mse_loss(model(x[:8]), y[:8])
        if step == 1 and acc.process_index == 1:
            loss = loss * math.inf  # one rank overflows; the all-reduce spreads it
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        changed = any(
            not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
        )
        history.append((opt.step_was_skipped, changed, sched.get_last_lr()[0], sched.last_epoch))
    return history


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for history in notebook_launcher(
        _overflow_worker, num_processes=2, return_all=True, backend="cpu"
    ):
        # Not split: the scheduler advances num_processes (2) times per real step.
        assert history == [
            (False, True, 0.1 * 0.5**2, 2),
            (True, False, 0.1 * 0.5**2, 2),
            (False, True, 0.1 * 0.5**4, 4),
        ]


def _shuffle_worker():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    epochs = [[i for (b,) in loader for i in b.tolist()] for _ in range(2)]
    return epochs, [acc.gather_object(e) for e in epochs]


def test_shuffling_without_a_seedable_sampler_stays_in_step_across_ranks():
    (mine, everyone), _ = notebook_launcher(
        _shuffle_worker, num_processes=2, return_all=True, backend="cpu"
    )
    for gathered in everyone:
        assert sorted(gathered) == list(range(20))  # disjoint shards covering the data
    assert mine[0] != mine[1]  # each epoch reshuffles


def _handlers_worker():
    from datetime import timedelta

    from notebook_accel import DistributedDataParallelKwargs, InitProcessGroupKwargs

    acc = Accelerator(
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[
            DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=1),
            InitProcessGroupKwargs(timeout=timedelta(seconds=60)),
        ],
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched, loader = acc.prepare(
        model, opt, sched, DataLoader(TensorDataset(*_data()), batch_size=8)
    )
    local_on_skipped_steps = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if not acc.sync_gradients:  # no all-reduce yet: gradients differ across ranks
                grad = acc.unwrap_model(model)[0].weight.grad
                local_on_skipped_steps.append(not torch.equal(acc.reduce(grad, "mean"), grad))
            opt.step()
            sched.step()
            opt.zero_grad()
    return model.find_unused_parameters, local_on_skipped_steps, sched.last_epoch


def test_handlers_reach_ddp_and_accumulation_skips_the_all_reduce():
    for unused, local, epochs in notebook_launcher(
        _handlers_worker, num_processes=2, return_all=True, backend="cpu"
    ):
        assert unused is True
        assert local == [True, True]  # 4 batches, accumulation 2: 2 skipped syncs
        assert epochs == 2  # split_batches: one scheduler step per optimizer step
