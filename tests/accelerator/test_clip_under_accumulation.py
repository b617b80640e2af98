"""Clipping on every micro-step under fp16 accumulation must not corrupt the gradients."""

from __future__ import annotations

import pytest
import torch

from notebook_accel import Accelerator


def train(clip_every_micro_step: bool) -> torch.Tensor:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = torch.randn(4, 8, 4), torch.randn(4, 8, 1)
    for x, y in zip(inputs, targets, strict=True):
        with accelerator.accumulate(model):
            accelerator.backward(((model(x) - y) ** 2).mean())
            if clip_every_micro_step or accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 100.0)  # large: never clips
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model).weight.detach().clone()


def test_clipping_on_accumulation_steps_is_skipped_with_a_warning():
    guarded = train(clip_every_micro_step=False)
    with pytest.warns(UserWarning, match="Clip when accelerator.sync_gradients is True"):
        every = train(clip_every_micro_step=True)
    assert torch.equal(every, guarded)
