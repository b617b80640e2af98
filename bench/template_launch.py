"""Launch time of 2 CPU workers forked from the template process (start_method="forkserver").

What a kernel that has initialised CUDA gets: it can no longer fork its
workers, so they are forked from a clean template process started once
(launch/template.py) instead of each starting a fresh interpreter ("spawn").
Every launch runs `Accelerator(cpu=True).wait_for_everyone()` in 2 CPU workers;
the figure is the whole call, the median over several rounds measured in this
same process, the start methods taking turns in each round:
  fork                 a warm fork launch (the reference)
  forkserver, first    the template's start included (it is ended before each)
  forkserver, later    the template already running
  spawn                a fresh interpreter per worker, every launch
Goal: the first forkserver launch at most 2 s over a fork launch (as spawn
today), every later one within 0.2 s of a warm fork launch.

    python bench/template_launch.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from notebook_accel import notebook_launcher
from notebook_accel.launch.template import shutdown_template, template_status

WORKERS = 2
# Later forkserver launches measured per round (each round starts one template).
LATER_PER_ROUND = 3


def accelerator_fn() -> None:
    from notebook_accel import Accelerator

    Accelerator(cpu=True).wait_for_everyone()


def launch_seconds(start_method: str) -> float:
    started = time.perf_counter()
    notebook_launcher(
        accelerator_fn, num_processes=WORKERS, backend="cpu", start_method=start_method, live=False
    )
    return time.perf_counter() - started


def measure(rounds: int) -> tuple[dict[str, list[float]], list[float]]:
    """Every start method's launch times, and each template's own start time."""
    for start_method in ("fork", "fork", "forkserver", "spawn"):  # imports and caches
        launch_seconds(start_method)
    shutdown_template()
    samples: dict[str, list[float]] = {
        "fork": [],
        "forkserver, first": [],
        "forkserver, later": [],
        "spawn": [],
    }
    template_starts = []
    for _ in range(rounds):
        samples["fork"].append(launch_seconds("fork"))
        samples["forkserver, first"].append(launch_seconds("forkserver"))
        template_starts.append(template_status().start_seconds)
        for _ in range(LATER_PER_ROUND):
            samples["forkserver, later"].append(launch_seconds("forkserver"))
        shutdown_template()
        samples["spawn"].append(launch_seconds("spawn"))
    return samples, template_starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        samples, template_starts = measure(rounds)
    finally:
        shutdown_template()
    medians = {name: statistics.median(taken) for name, taken in samples.items()}
    fork = medians["fork"]
    print(
        f"\n{WORKERS} CPU workers, Accelerator().wait_for_everyone(), whole call, "
        f"median of {rounds} rounds ({LATER_PER_ROUND} later forkserver launches each)\n"
    )
    print("| start method | whole call (ms) | - warm fork (ms) | / warm fork |")
    print("|---|---|---|---|")
    for name, seconds in medians.items():
        print(
            f"| {name} | {seconds * 1e3:.1f} | {(seconds - fork) * 1e3:+.1f} | "
            f"{seconds / fork:.2f}x |"
        )
    first, later = medians["forkserver, first"], medians["forkserver, later"]
    print(f"\ntemplate start (median): {statistics.median(template_starts):.2f} s")
    print(
        f"forkserver first launch - fork: {first - fork:+.2f} s (goal: at most +2 s); "
        f"spawn - fork: {medians['spawn'] - fork:+.2f} s"
    )
    print(
        f"forkserver later launch - warm fork: {later - fork:+.3f} s (goal: within 0.2 s); "
        f"{medians['spawn'] / later:.1f}x faster than spawn"
    )


if __name__ == "__main__":
    main()
