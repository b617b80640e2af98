"""What streaming metrics to the kernel costs a training loop.

Two CPU workers train a small MLP; a step takes about a millisecond and a half
(mostly the gloo all-reduce), so logging every step sends several hundred
records a second. Inside one launch the loop alternates blocks of steps with
and without `accelerator.log` on every step; comparing the median block times
keeps launch-to-launch noise (which core a worker lands on) out of the answer.
Goal: logging costs under 2% of step time.

    python bench/metrics.py [--blocks 40] [--steps-per-block 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from notebook_accel import Accelerator, last_run, notebook_launcher


def train(blocks: int, steps_per_block: int) -> dict[bool, list[float]]:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = torch.randn(16, 32), torch.randn(16, 8)
    block_seconds: dict[bool, list[float]] = {False: [], True: []}
    step = 0
    for block in range(blocks + 2):
        logging = block % 2 == 1
        started = time.perf_counter()
        for _ in range(steps_per_block):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if logging:
                accelerator.log({"loss": loss.detach(), "lr": 0.01}, step=step)
            step += 1
        if block >= 2:  # the first two blocks warm up
            block_seconds[logging].append((time.perf_counter() - started) / steps_per_block)
    return block_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps-per-block", type=int, default=200)
    options = parser.parse_args()
    started = time.perf_counter()
    seconds = notebook_launcher(
        train, args=(options.blocks, options.steps_per_block), num_processes=2, live=False
    )
    logged_steps = (options.blocks + 2) // 2 * options.steps_per_block  # warm-up included
    records = len(last_run().metrics)
    plain, logged = statistics.median(seconds[False]), statistics.median(seconds[True])
    rate = 1 / logged
    print(
        f"\n2 CPU workers, {options.blocks} blocks of {options.steps_per_block} steps, "
        f"alternating ({time.perf_counter() - started:.0f} s)\n"
    )
    print("| blocks | median ms per step | records/s reaching the kernel |")
    print("|---|---|---|")
    print(f"| no logging | {plain * 1e3:.3f} | 0 |")
    print(f"| log every step | {logged * 1e3:.3f} | {rate:.0f} |")
    print(
        f"\nlogging overhead: {(logged / plain - 1) * 100:+.1f}% of step time (goal: under 2%); "
        f"{records} of {logged_steps} records arrived"
    )


if __name__ == "__main__":
    main()
