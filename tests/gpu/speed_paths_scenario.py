"""fp8 and the batch copy on a real GPU, in one process, printed as JSON.

    python tests/gpu/speed_paths_scenario.py    # what tests/gpu/test_speed_paths.py reads

Its own process, so that CUDA starting here leaves the test process alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import traceback
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset


def float8_run(recipe: str | None = None) -> dict:
    """A model with two layers large enough for float8 and one too small, trained a few steps."""
    from notebook_accel import Accelerator, AORecipeKwargs

    handlers = [AORecipeKwargs(config=recipe)] if recipe else []
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 16),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = accelerator.prepare(model, optimizer)
    from torchao.float8.float8_linear import Float8Linear

    plain = accelerator.unwrap_model(model)
    linear = {n: m for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
    x = torch.randn(4096, 4096, device=accelerator.device)
    losses = []

    def step() -> None:
        loss = model(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    for _ in range(3):  # compiles the float8 layers
        step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        torch.cuda.synchronize()
    return {
        "float8": sorted(n for n, m in linear.items() if isinstance(m, Float8Linear)),
        "plain": sorted(n for n, m in linear.items() if not isinstance(m, Float8Linear)),
        "compiled": sorted(
            n for n, m in linear.items() if getattr(m, "_compiled_call_impl", None) is not None
        ),
        "scaled_mm_calls": sum("_scaled_mm" in event.name for event in profile.events()),
        "warnings": [str(w.message) for w in caught],
        "losses_finite": all(math.isfinite(v) for v in losses),
    }


def fp8() -> dict:
    capability = torch.cuda.get_device_capability()
    facts = {
        "capability": list(capability),
        "torchao": importlib.util.find_spec("torchao") is not None,
    }
    if capability < (8, 9) or not facts["torchao"]:
        from notebook_accel import Accelerator

        try:
            Accelerator(mixed_precision="fp8")
            facts["refused"] = None
        except ValueError as error:
            facts["refused"] = str(error)
        return facts
    facts["tensorwise"] = attempt(float8_run)
    if capability >= (9, 0):  # rowwise float8 matmuls need Hopper
        facts["rowwise"] = attempt(lambda: float8_run("rowwise"))
    return facts


def loader_values(loader) -> dict:
    batches = [batch for (batch,) in loader]
    return {
        "devices": sorted({str(b.device) for b in batches}),
        "values": torch.cat([b.cpu() for b in batches]).tolist(),
    }


def loaders() -> dict:
    """Prepared loaders on the GPU: what they decided, and that the values arrive intact."""
    from notebook_accel import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator()
    data = torch.arange(40, dtype=torch.float32).view(20, 2)
    results = {}
    for name, loader, config in (
        ("default", DataLoader(TensorDataset(data), batch_size=6), None),
        ("user_pinned", DataLoader(TensorDataset(data), batch_size=6, pin_memory=True), None),
        ("on_gpu_already", DataLoader(TensorDataset(data.cuda()), batch_size=6), None),
        ("blocking", DataLoader(TensorDataset(data), batch_size=6), False),
    ):
        accelerator.dataloader_config = DataLoaderConfiguration(non_blocking=config)
        prepared = accelerator.prepare(loader)
        results[name] = {
            "loader_pins": prepared.pin_memory,
            "pin_in_copy": prepared.mover.pin,
            "non_blocking": prepared.mover.non_blocking,
            "side_stream": prepared.mover.stream is not None,
            **loader_values(prepared),
        }
    results["expected"] = data.tolist()
    results["race_free"], results["race_on_side_stream"] = copies_ahead_without_races(accelerator)
    return results


def copies_ahead_without_races(accelerator) -> tuple[bool, bool]:
    """Large batches copied on the side stream while long kernels run on the training
    stream: each batch's sum must be its own (a missing wait would read a half copy).
    Also whether the 16 MiB batches did take the side stream."""
    accelerator.dataloader_config = type(accelerator.dataloader_config)()
    rows = torch.arange(8, dtype=torch.float32).repeat_interleave(4 << 20).view(8, -1)
    loader = accelerator.prepare(DataLoader(TensorDataset(rows), batch_size=1))
    heavy = torch.randn(4096, 4096, device=accelerator.device)
    sums = []
    for (batch,) in loader:
        for _ in range(20):  # keep the training stream busy while the next copy runs
            heavy = (heavy @ heavy).tanh_()
        sums.append(batch.sum().item())
    expected = [float(i * (4 << 20)) for i in range(8)]
    intact = all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(sums, expected, strict=True))
    return intact, bool(loader.mover.uses_stream)


def attempt(fn) -> dict:
    try:
        return {"ok": True, **fn()}
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {
            "ok": False,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }


def main() -> None:
    results = {"fp8": attempt(fp8), "loaders": attempt(loaders)}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
