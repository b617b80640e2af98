"""Memory per rank and step time of each ParallelismConfig layout, against DDP on the
same processes.

Four gloo workers (one torch thread each) train an MLP (width --width, 3 linear
layers, AdamW, batch 16 per data-parallel rank; with tp, prepare() splits the first
two layers by a plan) under each layout, and report
rank 0's bytes of parameters plus optimizer state (what a layout divides) and
the median step time after a warm-up; each ratio is against DDP measured in the
same run. On a 2-core machine four workers share two cores, so the times say
more about the collectives each layout adds than about a real cluster's speed.

    python bench/parallelism.py [--width 1024] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from notebook_accel import notebook_launcher

LAYOUTS = {
    "DDP (4 replicas)": None,
    "FSDP (dp_shard 4)": {"dp_shard_size": 4},
    "HSDP (2 x 2)": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "FSDP 2 x TP 2": {"dp_shard_size": 2, "tp_size": 2},
    "TP 4": {"tp_size": 4},
}
WORKERS = 4
BATCH = 16


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(width, 10))


def run(sizes: dict | None, width: int, steps: int) -> dict:
    from torch.distributed.tensor import DTensor

    from notebook_accel import Accelerator, ParallelismConfig

    config = ParallelismConfig(**sizes) if sizes else None
    accelerator = Accelerator(parallelism_config=config)
    model = _model(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Megatron's MLP: the first layer's outputs split over tp, the second's inputs.
    plan = {"0": "colwise", "2": "rowwise"} if config is not None and config.tp_enabled else None
    model, optimizer = accelerator.prepare(model, optimizer, tp_plan=plan)
    x, y = torch.randn(BATCH, width), torch.randint(0, 10, (BATCH,))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    parameters = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state = sum(
        local(value).numel() * value.element_size()
        for per_parameter in optimizer.state_dict()["state"].values()
        for value in per_parameter.values()
        if torch.is_tensor(value) and value.ndim > 0
    )
    return {"bytes": parameters + state, "step": statistics.median(times[steps // 4 :])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args()
    results = {
        name: notebook_launcher(
            run, args=(sizes, options.width, options.steps), num_processes=WORKERS, backend="cpu"
        )
        for name, sizes in LAYOUTS.items()
    }
    reference = results["DDP (4 replicas)"]
    print(
        f"{WORKERS} gloo workers, MLP width {options.width}, AdamW, batch {BATCH} per "
        "data-parallel rank; rank 0's parameters + optimizer state, median step"
    )
    print(f"{'layout':<20}{'bytes/rank':>12}{'vs DDP':>9}{'step (ms)':>11}{'vs DDP':>9}")
    for name, result in results.items():
        print(
            f"{name:<20}{result['bytes']:>12,}{result['bytes'] / reference['bytes']:>8.3f}x"
            f"{result['step'] * 1000:>11.1f}{result['step'] / reference['step']:>8.2f}x"
        )


if __name__ == "__main__":
    main()
