"""Accelerate options that are accepted but behave differently here say so."""

from __future__ import annotations

import pytest
import torch

from notebook_accel import Accelerator


def test_rng_types_is_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="rng_types is accepted for compatibility"):
        Accelerator(rng_types=["torch"])


class OldStyleOptimizer(torch.optim.SGD):
    def zero_grad(self):  # no set_to_none, as in some third-party optimizers
        super().zero_grad()


def test_an_optimizer_whose_zero_grad_takes_no_arguments_works():
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, OldStyleOptimizer(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    optimizer.zero_grad()
    assert model.weight.grad is None
