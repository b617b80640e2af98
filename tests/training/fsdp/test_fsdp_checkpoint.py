"""Sharded checkpoints: save_state on 2 FSDP workers, load_state on 2 and on 1.

Each rank writes its own shards (torch.distributed.checkpoint); loading
reshards them for however many processes load. After loading, training goes
on exactly as it did after the save (weights and AdamW state restored).
save_model gathers the whole weights into one file on the main process.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

from notebook_accel import Accelerator, load_model_weights, notebook_launcher
from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin

FEATURES = 8


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of `step` (16 samples)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, FEATURES, generator=g), torch.randn(16, 1, generator=g)
    share = 16 // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def _steps(acc, model, optimizer, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, acc.process_index, acc.num_processes)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def _prepared(seed: int):
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=200))
    model = _model(seed)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    return acc, model, optimizer


def _save(folder: str) -> dict:
    acc, model, optimizer = _prepared(seed=0)
    _steps(acc, model, optimizer, range(3))
    acc.save_state(os.path.join(folder, "state"))
    acc.save_model(model, os.path.join(folder, "weights"))
    saved = acc.get_state_dict(model)
    later = _steps(acc, model, optimizer, range(3, 5))
    return {"saved": saved, "later": later, "after": acc.get_state_dict(model)}


def _load(folder: str) -> dict:
    acc, model, optimizer = _prepared(seed=1)  # other weights, until loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(os.path.join(folder, "state"))
    # Copies: in one process the state dict holds views of the live parameters.
    loaded = {name: value.clone() for name, value in acc.get_state_dict(model).items()}
    later = _steps(acc, model, optimizer, range(3, 5))
    return {
        "sharded": type(acc.unwrap_model(model)).__name__.startswith("FSDP"),
        "loaded": loaded,
        "later": later,
        "after": acc.get_state_dict(model),
        "warnings": [str(w.message) for w in caught],
    }


def _assert_weights_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6)


def test_sharded_save_then_load_on_two_and_on_one_worker(tmp_path):
    folder = str(tmp_path)
    launch = {"return_all": True, "live": False}
    saved = notebook_launcher(
        _save, args=(folder,), num_processes=2, timeout=60, **launch, backend="cpu"
    )[0]
    files = sorted(os.listdir(tmp_path / "state" / "sharded"))
    print("sharded checkpoint files:", files)
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (tmp_path / "state" / "model.safetensors").exists()

    two = notebook_launcher(
        _load, args=(folder,), num_processes=2, timeout=60, **launch, backend="cpu"
    )[0]
    assert two["sharded"] and two["warnings"] == []
    _assert_weights_equal(two["loaded"], saved["saved"])
    torch.testing.assert_close(two["later"], saved["later"], rtol=1e-5, atol=1e-6)
    _assert_weights_equal(two["after"], saved["after"])

    one = notebook_launcher(_load, args=(folder,), num_processes=1, **launch, backend="cpu")[0]
    assert not one["sharded"]  # one process has nothing to shard with
    assert any("saved by 2 processes and loaded by 1" in w for w in one["warnings"])
    _assert_weights_equal(one["loaded"], saved["saved"])
    torch.testing.assert_close(one["later"], saved["later"], rtol=1e-4, atol=1e-5)
    _assert_weights_equal(one["after"], saved["after"])

    plain = _model(seed=2)
    load_model_weights(plain, tmp_path / "weights")
    _assert_weights_equal(plain.state_dict(), saved["saved"])


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, FEATURES)).sum().backward()
    optimizer.step()
    return optimizer


def test_own_shards_read_back_exactly_and_refuse_another_model_changing_nothing(tmp_path):
    from notebook_accel.training import fsdp

    saved = _model(seed=0)
    optimizer = _trained(saved)
    fsdp.save_own_shards(tmp_path / "own", [saved], [optimizer])
    assert sorted(os.listdir(tmp_path / "own")) == [".metadata", "__0_0.distcp"]

    model = _model(seed=1)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    fsdp.set_state([model], [fresh], fsdp.read_own_shards(tmp_path / "own", [model], [fresh]))
    _assert_weights_equal(model.state_dict(), saved.state_dict())
    for mine, theirs in zip(fresh.state.values(), optimizer.state.values(), strict=True):
        assert all(torch.equal(mine[key], theirs[key]) for key in ("step", "exp_avg", "exp_avg_sq"))

    wider = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh())
    deeper = torch.nn.Sequential(*_model(seed=1), torch.nn.Linear(1, 1))
    cases = [
        (wider, "model_0.0.weight was saved as the whole [32, 8], this process holds the whole"),
        (deeper, "Missing key in checkpoint state_dict: model_0.5.weight"),
    ]
    for other, expected in cases:
        before = {name: value.clone() for name, value in other.state_dict().items()}
        untouched = torch.optim.AdamW(other.parameters(), lr=0.01)
        with pytest.raises(ValueError, match=re.escape(expected)):
            fsdp.read_own_shards(tmp_path / "own", [other], [untouched])
        _assert_weights_equal(other.state_dict(), before)
        assert not untouched.state  # not even the state DCP makes by stepping once
    with pytest.raises(ValueError, match="its index cannot be read"):
        fsdp.read_own_shards(tmp_path / "elsewhere", [model], [fresh])
