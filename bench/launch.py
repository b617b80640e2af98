"""Launch overhead of 2 CPU workers: notebook_launcher against the references.

For each launcher, the same trivial function (record the time it starts, join
a gloo process group, one barrier) runs in 2 forked workers; for notebook_accel
also as `Accelerator(cpu=True).wait_for_everyone()`, as Accelerate's runs, and
with workers started in fresh interpreters (start_method="spawn", what a
kernel that has started CUDA gets). Two figures, the median of several runs
measured in this same process:
  to-inside  from the call until every worker is inside the function
  whole      the whole call, until it returns
References: raw torch.multiprocessing.start_processes (fork, and spawn for the
fresh start) with gloo init, and Accelerate's notebook_launcher (with
Accelerator(cpu=True)) when installed.

    python bench/launch.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing import start_processes

from notebook_accel import notebook_launcher

WORKERS = 2
# Each worker writes the time it entered the function to a file in this folder
# (a file, so that workers in fresh interpreters can too).
ENTRY_DIR = "BENCH_ENTRY_DIR"


def mark_entry(rank: int) -> None:
    Path(os.environ[ENTRY_DIR], str(rank)).write_text(repr(time.time()))


def ours_fn():
    mark_entry(int(os.environ["RANK"]))
    dist.init_process_group("gloo")
    dist.barrier()


def raw_fn(rank: int):
    mark_entry(rank)
    dist.init_process_group("gloo", rank=rank, world_size=WORKERS)
    dist.barrier()


def accelerate_fn():
    from accelerate import Accelerator

    mark_entry(int(os.environ["RANK"]))
    Accelerator(cpu=True).wait_for_everyone()


def ours_accelerator_fn():
    from notebook_accel import Accelerator

    mark_entry(int(os.environ["RANK"]))
    Accelerator(cpu=True).wait_for_everyone()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ours() -> None:
    notebook_launcher(ours_fn, num_processes=WORKERS)


def run_ours_accelerator() -> None:
    notebook_launcher(ours_accelerator_fn, num_processes=WORKERS)


def run_ours_spawn() -> None:
    notebook_launcher(ours_fn, num_processes=WORKERS, start_method="spawn")


def run_raw(start_method: str = "fork") -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORKERS)}
    )
    start_processes(raw_fn, nprocs=WORKERS, start_method=start_method)


def run_raw_spawn() -> None:
    run_raw("spawn")


def run_accelerate() -> None:
    from accelerate import notebook_launcher as accelerate_launcher

    accelerate_launcher(accelerate_fn, num_processes=WORKERS, use_port=str(free_port()))


def measure_once(run) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as folder:
        os.environ[ENTRY_DIR] = folder
        started = time.time()
        run()
        whole = time.time() - started
        entered = [float(path.read_text()) for path in Path(folder).iterdir()]
    assert len(entered) == WORKERS, "a worker never entered the function"
    return max(entered) - started, whole


def measure(runs: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (to inside, whole) per launcher, the launchers taking turns.

    Taking turns matters: forking gets slower as the parent process grows
    (each launcher leaves some state behind), so timing one launcher after
    the other would favour whichever goes first.
    """
    for run in runs.values():
        measure_once(run)  # warm up imports and caches
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(measure_once(run))
    return {
        name: (statistics.median(s[0] for s in taken), statistics.median(s[1] for s in taken))
        for name, taken in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    repeats = parser.parse_args().repeats
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    runs = {
        "raw fork + gloo": run_raw,
        "notebook_accel": run_ours,
        "notebook_accel, Accelerator()": run_ours_accelerator,
        "raw spawn + gloo": run_raw_spawn,
        "notebook_accel, start_method='spawn'": run_ours_spawn,
    }
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("(Accelerate is not installed: its column is left out)")
    else:
        runs["accelerate"] = run_accelerate
    rows = measure(runs, repeats)
    raw_inside, raw_whole = rows["raw fork + gloo"]
    ours_inside, ours_whole = rows["notebook_accel"]
    print(f"\n{WORKERS} CPU workers, median of {repeats} runs\n")
    print("| launcher | to inside (ms) | whole call (ms) | whole vs raw fork | ours faster by |")
    print("|---|---|---|---|---|")
    for name, (inside, whole) in rows.items():
        faster = f"{whole / ours_whole:.2f}x" if name == "accelerate" else "-"
        print(
            f"| {name} | {inside * 1e3:.1f} | {whole * 1e3:.1f} | "
            f"{whole / raw_whole:.2f}x | {faster} |"
        )
    print(
        f"\nnotebook_accel / raw: to inside {ours_inside / raw_inside:.2f}x, "
        f"whole {ours_whole / raw_whole:.2f}x (goal: within 1.3x)"
    )
    accelerator_whole = rows["notebook_accel, Accelerator()"][1]
    print(
        f"notebook_accel with Accelerator().wait_for_everyone() / raw, whole call: "
        f"{accelerator_whole / raw_whole:.2f}x (goal: within 1.3x)"
    )
    spawn_inside, spawn_whole = rows["notebook_accel, start_method='spawn'"]
    raw_spawn_whole = rows["raw spawn + gloo"][1]
    print(
        f"fresh interpreters (spawn) - fork, whole call: +{spawn_whole - ours_whole:.2f} s "
        f"(goal: at most 2 s); against raw spawn: {spawn_whole / raw_spawn_whole:.2f}x"
    )
    if "accelerate" in rows:
        print(
            f"accelerate / notebook_accel whole call: {rows['accelerate'][1] / ours_whole:.2f}x "
            "(goal: at least 2x)"
        )


if __name__ == "__main__":
    main()
