"""Where a prepared GPU step loses time against the hand-written one.

Three views of the same two models as bench/gpu.py (lm in bf16, mlp in fp32):
  parts     steps/s with one part prepared at a time (the loader, the model, the
            optimizer, `accelerator.backward`), the rest hand-written, taking turns;
            ratios against the hand-written loop of the same run
  calls     CUDA runtime calls and kernels per step, from torch.profiler, for the
            hand-written and the prepared loop: a synchronising call (stream, event or
            device synchronize, a blocking copy) shows up here, and so do extra kernels
  syncs     every host-device synchronisation torch reports in prepared steps
            (torch.cuda.set_sync_debug_mode), with the line that made it, in bf16,
            fp16 and fp8 (where the GPU and torchao allow)

    python bench/gpu_breakdown.py [--rounds 3] [--only parts,calls,syncs]
    python bench/gpu_breakdown.py --dry-run    # tiny models on the CPU: the script only
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))

import gpu as bench  # noqa: E402  (bench/gpu.py: the models and data)

from notebook_accel import Accelerator  # noqa: E402

PARTS = ("loader", "model", "optimizer", "backward")
LOOPS = {
    "hand-written": (),
    **{f"{part} prepared": (part,) for part in PARTS},
    "all prepared": PARTS,
}
# Runtime calls that make the host wait for the device (or may).
SYNCING = (
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMalloc",
    "cudaFree",
)


def steps(
    parts: tuple[str, ...],
    model_name: str,
    precision: str,
    sizes: Any,
    device: torch.device,
    n: int,
) -> Iterator[None]:
    """A training loop with `parts` done by an Accelerator and the rest by hand."""
    accelerator = Accelerator(mixed_precision=precision, cpu=device.type == "cpu")
    model = bench.build(model_name, sizes, device)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pin = device.type == "cuda" and "loader" not in parts
    loader: Any = DataLoader(
        bench.dataset(model_name, sizes, n),
        batch_size=bench.batch_size(model_name, sizes),
        pin_memory=pin,
    )
    if "model" in parts:
        model = accelerator.prepare_model(model)
    if "optimizer" in parts:
        optimizer = accelerator.prepare_optimizer(optimizer)
    if "loader" in parts:
        loader = accelerator.prepare_data_loader(loader)
    dtype = bench.DTYPES.get(precision)
    by_hand = dtype is not None and "model" not in parts
    for x, y in loader:
        if "loader" not in parts:
            x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        with torch.autocast(device.type, dtype) if by_hand else contextlib.nullcontext():
            loss = bench.loss_of(model(x), y)
        if "backward" in parts:
            accelerator.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        yield
    accelerator.free_memory()


def timed(loop: Iterator[None], warmup: int, count: int, device: torch.device) -> float:
    for _ in range(warmup):
        next(loop)
    bench.synchronize(device)
    started = time.perf_counter()
    for _ in range(count):
        next(loop)
    bench.synchronize(device)
    return count / (time.perf_counter() - started)


def parts_table(sizes: Any, device: torch.device, rounds: int) -> None:
    for model_name, precision in (("lm", "bf16"), ("mlp", "no")):
        warmup, count = sizes.warmup[model_name], sizes.steps[model_name]
        rates: dict[str, list[float]] = {name: [] for name in LOOPS}
        for _ in range(rounds):
            for name, parts in LOOPS.items():
                loop = steps(parts, model_name, precision, sizes, device, warmup + count)
                rates[name].append(timed(loop, warmup, count, device))
                loop.close()
        reference = statistics.median(rates["hand-written"])
        print(f"\n{model_name} {precision}: steps/s, median of {rounds}, vs hand-written")
        for name, values in rates.items():
            median = statistics.median(values)
            print(f"  {name:20s} {median:8.1f}  {median / reference:.3f}x  {values}")


def profiled(parts: tuple[str, ...], model_name: str, precision: str, sizes: Any, device) -> dict:
    """Runtime calls and kernels per step over `count` steps after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    warmup, count = sizes.warmup[model_name], 10
    loop = steps(parts, model_name, precision, sizes, device, warmup + count)
    for _ in range(warmup):
        next(loop)
    bench.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(count):
            next(loop)
        bench.synchronize(device)
    loop.close()
    calls: collections.Counter = collections.Counter()
    for event in prof.events():
        kind = "kernel" if event.device_type.name == "CUDA" else "cpu"
        calls[(kind, event.name)] += 1
    return {key: value / count for key, value in calls.items()}


def calls_table(sizes: Any, device: torch.device) -> None:
    for model_name, precision in (("lm", "bf16"), ("mlp", "no")):
        hand = profiled((), model_name, precision, sizes, device)
        ours = profiled(PARTS, model_name, precision, sizes, device)
        print(f"\n{model_name} {precision}: calls per step, hand-written -> prepared (differences)")
        for key in sorted(set(hand) | set(ours)):
            a, b = hand.get(key, 0.0), ours.get(key, 0.0)
            syncing = any(key[1].startswith(name) for name in SYNCING)
            if abs(a - b) > 0.05 or (syncing and max(a, b) > 0):
                mark = " <- may wait for the device" if syncing else ""
                print(f"  {key[0]:6s} {key[1][:90]:90s} {a:7.1f} -> {b:7.1f}{mark}")


def syncs_table(sizes: Any, device: torch.device) -> None:
    if device.type != "cuda":
        print("\nsyncs: needs a CUDA device")
        return
    cases = [("lm", "bf16"), ("lm", "fp16"), ("mlp", "no")]
    if torch.cuda.get_device_capability(device) >= (8, 9) and importlib.util.find_spec("torchao"):
        cases.append(("wide", "fp8"))
    for model_name, precision in cases:
        found = synchronisations(model_name, precision, sizes, device)
        print(f"\n{model_name} {precision}: {sum(found.values())} synchronisation(s) in 3 steps")
        for where, times in found.most_common():
            print(f"  {times}x {where}")


def synchronisations(model_name: str, precision: str, sizes: Any, device) -> collections.Counter:
    """Where prepared steps synchronise, by the innermost frames outside torch."""
    warmup, count = sizes.warmup[model_name], 3
    if model_name == "wide":
        loop = wide_steps(precision, sizes, device, warmup + count)
    else:
        loop = steps(PARTS, model_name, precision, sizes, device, warmup + count)
    for _ in range(warmup):
        next(loop)
    found: collections.Counter = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "called a synchronizing CUDA operation" in str(message):
                stack = traceback.extract_stack()[:-2]
                frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-6:]]
                found[f"{str(message)[:60]} | " + " < ".join(reversed(frames))] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(count):
                next(loop)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    loop.close()
    return found


def wide_steps(precision: str, sizes: Any, device: torch.device, n: int) -> Iterator[None]:
    accelerator = Accelerator(mixed_precision=precision)
    model = bench.build("wide", sizes, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = bench.wide_batch(sizes, device)
    for _ in range(n):
        accelerator.backward(bench.loss_of(model(x), None))
        optimizer.step()
        optimizer.zero_grad()
        yield
    accelerator.free_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="parts,calls,syncs")
    parser.add_argument("--dry-run", action="store_true")
    options = parser.parse_args()
    if options.dry_run:
        device, sizes, rounds = torch.device("cpu"), bench.TINY, 1
    else:
        device, rounds = torch.device("cuda", 0), options.rounds
        # the wide model serves the fp8 sync check only: half bench/gpu.py's width will do
        sizes = bench.Sizes(wide_width=4096, wide_tokens=4096)
    only = options.only.split(",")
    print(bench.environment(device))
    if "parts" in only:
        parts_table(sizes, device, rounds)
    if "calls" in only:
        calls_table(sizes, device)
    if "syncs" in only:
        syncs_table(sizes, device)


if __name__ == "__main__":
    main()
