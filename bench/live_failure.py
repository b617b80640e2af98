"""Time from a rank's exception to the error in the cell, on 2 live CPU workers.

    python bench/live_failure.py [--calls 20]

in a collective   rank 1 raises while rank 0 waits for it in an all-reduce: rank 0
                  is taken out of it, the process group is formed again, then the
                  cell gets rank 1's error (the goal: within 2 s)
alone             rank 1 raises while rank 0 returns at once: the floor, an
                  exception's plain round trip

Median and worst of `--calls` calls each, measured in this same process.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from notebook_accel import WorkerError
from notebook_accel.live import start_workers

CELL = """
import torch
import torch.distributed as dist

def fail(inside):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 failed")
    if inside:
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
    return "fine"
"""


def time_to_error(workers, source: str) -> float:
    started = time.perf_counter()
    try:
        workers.run_cell(source, timeout=60)
    except WorkerError as error:
        assert error.rank == 1, error
        return time.perf_counter() - started
    raise AssertionError("the call did not fail")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    calls = parser.parse_args().calls
    warnings.simplefilter("ignore")
    rows = {}
    with start_workers(2, backend="cpu", live=False) as workers:
        workers.run_cell(CELL)
        for name, source in (("in a collective", "fail(True)"), ("alone", "fail(False)")):
            rows[name] = [time_to_error(workers, source) for _ in range(calls)]
    floor = statistics.median(rows["alone"])
    print("| rank 1 raises | median (ms) | worst (ms) | median vs alone |")
    print("|---|---|---|---|")
    for name, samples in rows.items():
        median = statistics.median(samples)
        print(f"| {name} | {median * 1e3:.1f} | {max(samples) * 1e3:.1f} | {median / floor:.0f}x |")


if __name__ == "__main__":
    main()
