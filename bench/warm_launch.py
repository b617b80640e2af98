"""Launch after launch in one interpreter: warm launches, against the references.

Warmth belongs to a process, so every launcher gets a fresh interpreter per
round; the launchers take turns and the medians of the rounds are printed.
Three patterns:

  sweep    a loop of launches in one cell, no pause (a hyper-parameter sweep,
           "Run All"): LAUNCHES_SWEEP launches of a training function that
           builds torch.nn.Linear + torch.optim.AdamW, prepares them and takes
           one optimizer step. Figure: call -> every worker has stepped.
  edit     the same with `--pause` seconds between launches, as a person
           editing a cell would.
  trivial  `Accelerator().wait_for_everyone()` (the raw reference: fork + gloo
           init + barrier), called LAUNCHES_TRIVIAL times in a row. Figure: the
           whole call.

Launchers:
  raw fork        torch.multiprocessing.start_processes(fork) + init_process_group
                  (+ DistributedDataParallel and AdamW for the training pattern), the floor
  notebook_accel  notebook_launcher with Accelerator().prepare
  notebook_accel warm=False  the same with warming off
  accelerate      Accelerate's notebook_launcher with its Accelerator, when installed

    python bench/warm_launch.py [--rounds 5] [--workers 2] [--device cpu|cuda]
        [--pattern sweep edit trivial] [--pause 5]

With --device cuda every worker trains on a GPU of its own (nccl); with one
GPU, one forked worker (notebook_accel would otherwise run a single worker in
this process). Accelerate runs a single process in this process, so with one
GPU its column is left out.

Python's bytecode cache matters here: with PYTHONDONTWRITEBYTECODE set, every
module a worker imports is compiled again in every launch. The script says so
when it is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

LAUNCHES_SWEEP = 5
LAUNCHES_EDIT = 3
LAUNCHES_TRIVIAL = 3
# When each worker finished its first optimizer step; shared with forked children.
STEPPED = None


def _stamp() -> None:
    STEPPED[int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))] = time.time()


def _step(model, optimizer, device) -> None:
    import torch

    loss = model(torch.randn(8, 16, device=device)).square().mean()
    loss.backward()
    optimizer.step()


def _first_step(accelerator_class, device: str) -> None:
    """Build, prepare and step the model with `accelerator_class` (ours or Accelerate's)."""
    import torch

    accelerator = accelerator_class(cpu=device == "cpu")
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(model, optimizer, accelerator.device)
    _stamp()


def _barrier_only(accelerator_class, device: str) -> None:
    accelerator_class(cpu=device == "cpu").wait_for_everyone()
    _stamp()


def ours_fn(device: str, trivial: bool) -> None:
    from notebook_accel import Accelerator

    (_barrier_only if trivial else _first_step)(Accelerator, device)


def accelerate_fn(device: str, trivial: bool) -> None:
    from accelerate import Accelerator

    (_barrier_only if trivial else _first_step)(Accelerator, device)


def raw_fn(rank: int, device: str, workers: int, trivial: bool) -> None:
    import torch
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    if device == "cuda":
        torch.cuda.set_device(rank)
    where = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=workers)
    if not trivial:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            torch.nn.Linear(16, 4).to(where), device_ids=[rank] if device == "cuda" else None
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _step(model, optimizer, where)
    _stamp()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(name: str, device: str, workers: int, trivial: bool) -> None:
    if name == "raw fork":
        from torch.multiprocessing import start_processes

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
        start_processes(
            raw_fn, args=(device, workers, trivial), nprocs=workers, start_method="fork"
        )
    elif name.startswith("notebook_accel"):
        from notebook_accel.launch.launcher import run_plan
        from notebook_accel.launch.preflight import plan_launch
        from notebook_accel.reporting.observers import ConsoleObserver

        # single_in_process=False: one GPU still gets a forked worker.
        plan = plan_launch(
            function=ours_fn,
            args=(device, trivial),
            num_processes=workers,
            backend=device,
            single_in_process=False,
            warm=name == "notebook_accel",
        )
        run_plan(plan, ConsoleObserver(plan.output))
    else:
        from accelerate import notebook_launcher

        notebook_launcher(
            accelerate_fn,
            args=(device, trivial),
            num_processes=workers,
            use_port=str(_free_port()),
        )


def child(name: str, args: argparse.Namespace) -> None:
    """One interpreter: the launches of one pattern by one launcher; prints JSON."""
    global STEPPED
    warnings.simplefilter("ignore")
    import torch  # noqa: F401 - a notebook has torch imported before its first launch

    trivial = args.child_pattern == "trivial"
    count = {"sweep": LAUNCHES_SWEEP, "edit": LAUNCHES_EDIT, "trivial": LAUNCHES_TRIVIAL}[
        args.child_pattern
    ]
    pause = args.pause if args.child_pattern == "edit" else 0.0
    STEPPED = multiprocessing.Array("d", args.workers, lock=False)
    first_step, whole, warming = [], [], []
    for launch in range(count):
        if launch and pause:
            time.sleep(pause)
        for rank in range(args.workers):
            STEPPED[rank] = 0.0
        started = time.time()
        _launch(name, args.device, args.workers, trivial)
        whole.append(time.time() - started)
        if not all(STEPPED):
            raise RuntimeError(f"{name}: a worker never took its step")
        first_step.append(max(STEPPED) - started)
        if name.startswith("notebook_accel"):
            from notebook_accel import last_run

            warming.append(last_run().warming.seconds)
    print(json.dumps({"first_step": first_step, "whole": whole, "warming": warming}))


def _run_child(name: str, pattern: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", name, "--child-pattern", pattern]
    command += ["--device", args.device, "--workers", str(args.workers)]
    command += ["--pause", str(args.pause)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name} ({pattern}) failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _launchers(args: argparse.Namespace) -> list[str]:
    names = ["raw fork", "notebook_accel", "notebook_accel warm=False"]
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("(Accelerate is not installed: its column is left out)")
        return names
    if args.device == "cuda" and args.workers == 1:
        print("(Accelerate runs one GPU worker in this process: its column is left out)")
        return names
    return [*names, "accelerate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--pattern",
        nargs="+",
        choices=("sweep", "edit", "trivial"),
        default=["sweep", "edit", "trivial"],
    )
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between edit launches")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-pattern", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers is None:
        args.workers = 2 if args.device == "cpu" else _gpu_count()
    if args.workers < 1:
        raise SystemExit("--device cuda: this machine has no GPU that torch can see")
    if args.child:
        child(args.child, args)
        return
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("(PYTHONDONTWRITEBYTECODE is set: every launch compiles what its workers import)")
    names = _launchers(args)
    for pattern in args.pattern:
        samples: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:  # taking turns spreads the machine's load over all of them
                samples[name].append(_run_child(name, pattern, args))
        _print_table(pattern, samples, args)


def _gpu_count() -> int:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda._device_count_nvml()


def _medians(runs: list[dict], key: str) -> list[float]:
    launches = len(runs[0][key])
    return [statistics.median(run[key][i] for run in runs) for i in range(launches)]


def _print_table(pattern: str, samples: dict[str, list[dict]], args: argparse.Namespace) -> None:
    key = "whole" if pattern == "trivial" else "first_step"
    medians = {name: _medians(runs, key) for name, runs in samples.items()}
    launches = len(medians["notebook_accel"])
    what = {
        "sweep": "call -> first step in every worker, no pause between launches",
        "edit": f"call -> first step in every worker, {args.pause:g} s between launches",
        "trivial": "whole call of Accelerator().wait_for_everyone(), no pause between calls",
    }[pattern]
    print(
        f"\n### {pattern}: {args.workers} {args.device} worker(s), {what}, "
        f"median of {args.rounds} fresh interpreters\n"
    )
    print("| launcher | " + " | ".join(f"launch {i + 1} (s)" for i in range(launches)) + " |")
    print("|---|" + "---|" * launches)
    for name, row in medians.items():
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in row) + " |")
    for ours in ("notebook_accel", "notebook_accel warm=False"):
        for reference in ("accelerate", "raw fork"):
            if reference in medians:
                ratios = [o / r for o, r in zip(medians[ours], medians[reference], strict=True)]
                print(
                    f"\n{ours} / {reference}: "
                    + ", ".join(f"launch {i + 1} {x:.2f}x" for i, x in enumerate(ratios))
                )
    if pattern == "trivial":
        print("(goal: from call 2 on, at most 1.3x raw fork; warm=False at most 2x)")
    else:
        print(
            "(goal: launch 1 whole call at most 1.1x accelerate; from launch 3 on at most 0.2x,"
            " from launch 2 on where the kernel is idle between launches)"
        )
        whole = {name: _medians(runs, "whole") for name, runs in samples.items()}
        print("\nwhole call per launch (s): ")
        for name, row in whole.items():
            print(f"  {name}: " + ", ".join(f"{t:.3f}" for t in row))
        if "accelerate" in whole:
            first = whole["notebook_accel"][0] / whole["accelerate"][0]
            print(f"notebook_accel / accelerate, launch 1 whole call: {first:.2f}x (goal: 1.1x)")
    if args.device == "cuda" and pattern != "trivial":
        best = max(medians["notebook_accel"][1:])
        print(f"GPU worker from a warm kernel: {best:.3f} s to its first step (goal: 1 s)")
    warming = [run["warming"] for run in samples["notebook_accel"]]
    per_launch = [statistics.median(w[i] for w in warming) for i in range(launches)]
    print(
        "kernel-side warming in each launch (s, on the launching thread): "
        + ", ".join(f"{w:.2f}" for w in per_launch)
    )


if __name__ == "__main__":
    main()
