"""Prepared training steps on a real GPU under torch's synchronisation check, as JSON.

    python tests/gpu/step_syncs_scenario.py    # what tests/gpu/test_step_syncs.py reads

After warm-up steps, each case runs steps under torch.cuda.set_sync_debug_mode:
"error" where nothing may make the host wait for the GPU (the first
synchronisation raises, with its traceback), "warn" where torch itself waits (a
plain optimizer under fp16: GradScaler reads the overflow flag once per step) to
list every place that did. Its own process, so CUDA starting here leaves the test
process alone.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

WARMUP, STEPS = 3, 6


def loader(batch_bytes: str) -> DataLoader:
    """Small batches (copied on the training stream) or large ones (on the side stream)."""
    generator = torch.Generator().manual_seed(0)
    width, batch = (256, 32) if batch_bytes == "small" else (4096, 128)  # 32 KiB or 2 MiB
    n = (WARMUP + STEPS) * batch
    x = torch.randn(n, width, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(10, (n,), generator=generator)), batch)


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
    )


def prepared_steps(precision: str, fused: bool, batches: str, accumulation: int, mode: str) -> dict:
    """Steps of a prepared loop (accumulate, backward, step, zero_grad, gather_for_metrics,
    log of a Python number), the last ones under the synchronisation check."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=accumulation)
    data = loader(batches)
    net = model(data.dataset.tensors[0].shape[1])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=fused or None)
    net, optimizer, data = accelerator.prepare(net, optimizer, data)
    found: list[str] = []
    gathered = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "called a synchronizing CUDA operation" in str(message):
                frames = traceback.extract_stack()[:-1]
                found.append(" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-5:]))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        try:
            for index, (x, y) in enumerate(data):  # the loader's copies are checked too
                if index == WARMUP:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode(mode)
                with accelerator.accumulate(net):
                    logits = net(x)
                    loss = torch.nn.functional.cross_entropy(logits, y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                gathered += len(accelerator.gather_for_metrics(logits.argmax(dim=1)))
                accelerator.log({"lr": optimizer.param_groups[0]["lr"]}, step=index)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    copies_on_side_stream = bool(data.mover.uses_stream)
    return {"syncs": found, "gathered": gathered, "side_stream": copies_on_side_stream}


def fp8_steps() -> dict:
    """fp8 (torchao float8 layers, compiled): wide layers, a batch kept on the GPU."""
    from notebook_accel import Accelerator

    accelerator = Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, optimizer = accelerator.prepare(net, optimizer)
    x = torch.randn(4096, 4096, device=accelerator.device)
    try:
        for index in range(WARMUP + STEPS):
            if index == WARMUP:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            accelerator.backward(net(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"syncs": []}


def attempt(fn) -> dict:
    try:
        return {"ok": True, **fn()}
    except Exception as error:  # noqa: BLE001 - reported to the test
        torch.cuda.set_sync_debug_mode("default")
        return {
            "ok": False,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }


CASES = {
    "fp32": ("no", False, "small", 1, "error"),
    "bf16": ("bf16", False, "small", 1, "error"),
    "bf16_accumulating": ("bf16", False, "small", 2, "error"),
    "bf16_large_batches": ("bf16", False, "large", 1, "error"),
    "fp16_fused": ("fp16", True, "small", 1, "error"),
    "fp16_plain": ("fp16", False, "small", 1, "warn"),
}


def main() -> None:
    results = {
        name: attempt(lambda case=case: prepared_steps(*case)) for name, case in CASES.items()
    }
    capability = torch.cuda.get_device_capability()
    if capability >= (8, 9) and importlib.util.find_spec("torchao") is not None:
        results["fp8"] = attempt(fp8_steps)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
