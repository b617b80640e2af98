"""What streaming metrics to the kernel costs a training loop.

Two CPU workers train a small MLP; each step takes about a millisecond, so
logging every step sends on the order of 1,000 records a second. The same
loop runs with and without `accelerator.log` on every step, alternating,
and the median step times are compared (goal: under 2% slower).

    python bench/metrics.py [--steps 3000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from notebook_accel import Accelerator, last_run, notebook_launcher


def train(steps: int, log_every_step: bool) -> float:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = torch.randn(32, 64), torch.randn(32, 8)
    started = time.perf_counter()
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if log_every_step:
            accelerator.log({"loss": loss.detach(), "lr": 0.01}, step=step)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    records_per_second = []
    notebook_launcher(train, args=(200, True), num_processes=2, live=False)  # warm up
    for _ in range(options.repeats):
        for logging in (False, True):
            step = notebook_launcher(
                train, args=(options.steps, logging), num_processes=2, live=False
            )
            times[logging].append(step)
            if logging:
                records_per_second.append(len(last_run().metrics) / (step * options.steps))
    plain, logged = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n2 CPU workers, {options.steps} steps, median of {options.repeats} runs each\n")
    print("| loop | ms per step | records/s reaching the kernel |")
    print("|---|---|---|")
    print(f"| no logging | {plain * 1e3:.3f} | 0 |")
    print(f"| log every step | {logged * 1e3:.3f} | {statistics.median(records_per_second):.0f} |")
    print(f"\nlogging overhead: {(logged / plain - 1) * 100:+.1f}% of step time (goal: under 2%)")


if __name__ == "__main__":
    main()
