"""Training-step speed of the Accelerator against a hand-written DDP loop.

Two gloo workers (one torch thread each, the launcher's default) train the same
MLP (3 linear layers of width 512, batch 64 per process, SGD, synthetic data):
  hand-written  DistributedDataParallel + DistributedSampler, plain loop
  notebook_accel  Accelerator().prepare(...) with accumulate/backward
  accelerate    Accelerate 1.15's Accelerator, when installed
All run in the same workers, interleaved over several rounds (the median
counts), from the same initial weights on the same data; the script checks
that they end with the same weights and prints steps/s and the ratios.

    python bench/step.py [--steps 150] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from notebook_accel import notebook_launcher

WIDTH, CLASSES, BATCH, WORKERS = 512, 10, 64, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )


def _dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = steps * BATCH * WORKERS
    return TensorDataset(
        torch.randn(n, WIDTH, generator=g), torch.randint(CLASSES, (n,), generator=g)
    )


def _timed(loop, warmup: int = 10) -> tuple[float, list[torch.Tensor]]:
    """Run `loop`, which yields the model after every step; steps/s after the warm-up."""
    start, steps, last = 0.0, 0, None
    for steps, last in enumerate(loop(), start=1):  # noqa: B007 - `last` is used after
        if steps == warmup:
            start = time.perf_counter()
    rate = (steps - warmup) / (time.perf_counter() - start)
    return rate, [p.detach().clone() for p in last.parameters()]


def hand_written(steps: int):
    from torch.nn.parallel import DistributedDataParallel

    data = _dataset(steps)
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield model.module


def ours(steps: int):
    from notebook_accel import Accelerator

    yield from _accelerated_loop(Accelerator(), steps)


def theirs(steps: int):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield from _accelerated_loop(accelerate.Accelerator(cpu=True), steps)


def _accelerated_loop(acc, steps: int):
    """The same training code for both Accelerators: porting is an import change."""
    model = _model()
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        DataLoader(_dataset(steps), batch_size=BATCH),
    )
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        yield acc.unwrap_model(model)


def worker(steps: int, rounds: int) -> dict:
    import importlib.util

    from notebook_accel import Accelerator

    Accelerator()  # joins the process group, which the hand-written loop then uses too
    variants = {"hand-written DDP": hand_written, "notebook_accel": ours}
    if importlib.util.find_spec("accelerate") is not None:
        variants["accelerate"] = theirs
    rates: dict[str, list[float]] = {name: [] for name in variants}
    weights = {}
    for _ in range(rounds):
        for name, loop in variants.items():
            rate, weights[name] = _timed(lambda loop=loop: loop(steps))
            rates[name].append(rate)
    reference = weights["hand-written DDP"]
    drift = {
        name: max((a - b).abs().max().item() for a, b in zip(w, reference, strict=True))
        for name, w in weights.items()
    }
    return {name: (statistics.median(r), drift[name], num_threads()) for name, r in rates.items()}


def num_threads() -> int:
    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    results = notebook_launcher(worker, args=(options.steps, options.rounds), num_processes=WORKERS)
    base = results["hand-written DDP"][0]
    print(
        f"{WORKERS} gloo workers, MLP width {WIDTH}, batch {BATCH}/process, {options.steps} steps"
    )
    print(f"{'loop':<18}{'steps/s':>9}{'vs hand-written':>17}{'max |dw|':>11}{'threads':>9}")
    for name, (rate, drift, threads) in results.items():
        print(f"{name:<18}{rate:>9.1f}{rate / base:>16.2f}x{drift:>11.1e}{threads:>9}")
    worst = max(drift for _, drift, _ in results.values())
    if worst > 1e-4:
        raise SystemExit(f"the loops disagree: weights differ by up to {worst:.1e}")
    print("all loops reach the same weights")


if __name__ == "__main__":
    main()
