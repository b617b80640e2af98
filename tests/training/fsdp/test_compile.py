"""`torch.compile` from `prepare`: the compiled model trains like the plain one.

The two-worker runs use the "aot_eager" backend: it traces the model through
dynamo and AOTAutograd like "inductor" but skips code generation, which keeps
each run to seconds on a busy 2-core machine (inductor's first C++ build takes
much longer there). One single-process test runs inductor itself.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from notebook_accel.training.compile import unwrap_compiled


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 1),
    )


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(data, batch_size=8)


def _train(**accelerator_options) -> dict:
    acc = Accelerator(**accelerator_options)
    original = _model()
    optimizer = torch.optim.SGD(original.parameters(), lr=0.05)
    model, optimizer, loader = acc.prepare(original, optimizer, _loader())
    losses = []
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    unwrapped = acc.unwrap_model(model)
    return {
        "losses": losses,
        "prepared": type(model).__name__,
        "unwrapped_is_original": unwrapped is original,
        "unwrapped": type(unwrapped).__name__,
        "weights": acc.get_state_dict(model),
    }


def _compiled_and_plain(fsdp: bool, accumulation: int) -> dict:
    plugin = FullyShardedDataParallelPlugin() if fsdp else None
    common = {"fsdp_plugin": plugin, "gradient_accumulation_steps": accumulation}
    return {
        "compiled": _train(dynamo_backend="aot_eager", **common),
        "plain": _train(**common),
    }


@pytest.mark.parametrize(
    "fsdp,accumulation,wrapper",
    [
        pytest.param(False, 2, "Sequential", id="ddp-accumulate"),
        pytest.param(True, 1, "FSDPSequential", id="fsdp"),
    ],
)
def test_compiled_model_trains_like_the_plain_one(fsdp, accumulation, wrapper):
    results = notebook_launcher(
        _compiled_and_plain,
        args=(fsdp, accumulation),
        num_processes=2,
        return_all=True,
        live=False,
        timeout=90,
        backend="cpu",
    )
    compiled, plain = results[0]["compiled"], results[0]["plain"]
    print("compiled losses", [round(v, 5) for v in compiled["losses"]])
    print("plain losses   ", [round(v, 5) for v in plain["losses"]])
    assert compiled["prepared"] == "OptimizedModule"
    # unwrap_model gives back the user's own module object (for FSDP2 the same
    # object, its class swapped for an FSDP subclass).
    assert compiled["unwrapped_is_original"] and plain["unwrapped_is_original"]
    assert compiled["unwrapped"] == plain["unwrapped"] == wrapper
    torch.testing.assert_close(compiled["losses"], plain["losses"], rtol=1e-5, atol=1e-5)
    assert set(compiled["weights"]) == set(plain["weights"])  # no "_orig_mod." prefixes
    for name, value in plain["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], value, rtol=1e-5, atol=1e-5)


def test_inductor_compiles_on_cpu_in_one_process():
    compiled = _train(dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    plain = _train()
    torch.testing.assert_close(compiled["losses"], plain["losses"], rtol=1e-4, atol=1e-5)
    for name, value in plain["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], value, rtol=1e-4, atol=1e-5)


def test_compile_true_means_inductor_and_no_backend_means_no_compiling():
    assert Accelerator(compile=True).dynamo_plugin.backend == "inductor"
    assert Accelerator(dynamo_backend="NO").dynamo_plugin is None
    assert Accelerator().dynamo_plugin is None
    with pytest.raises(ValueError, match="not both"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin())


def test_inductor_without_a_cpp_compiler_is_refused_up_front(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*aot_eager"):
        Accelerator(dynamo_backend="inductor", cpu=True)


def test_unwrap_compiled_leaves_plain_modules_alone():
    model = torch.nn.Linear(2, 2)
    assert unwrap_compiled(model) is model
    assert unwrap_compiled(torch.compile(model, backend="eager")) is model
