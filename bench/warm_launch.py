"""Call -> first optimizer step, launch after launch in one process: warm launches.

A training function builds torch.nn.Linear + torch.optim.AdamW, prepares them
and takes one optimizer step; every worker records when that step is done. The
figure is the time from the launch call until every worker has stepped, for
launches 1, 2, 3 in one interpreter (warmth belongs to a process, so each
launcher gets a fresh interpreter per round; the launchers take turns and the
medians of the rounds are printed). Between launches the script waits
`--pause` seconds, as a person editing a cell would.

  raw fork      torch.multiprocessing.start_processes(fork) + init_process_group
                + DistributedDataParallel, the floor
  notebook_accel  notebook_launcher with Accelerator().prepare
  notebook_accel warm=False  the same with warming off (launch 1 as it was before)
  accelerate    Accelerate's notebook_launcher with its Accelerator, when installed

    python bench/warm_launch.py [--rounds 5] [--workers 2] [--device cpu|cuda]

With --device cuda every worker trains on a GPU of its own (nccl); with one
GPU, one forked worker (notebook_accel would otherwise run a single worker in
this process). Accelerate runs a single process in this process, so with one
GPU its column is left out.
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

LAUNCHES = 3
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


def ours_fn(device: str) -> None:
    from notebook_accel import Accelerator

    _first_step(Accelerator, device)


def accelerate_fn(device: str) -> None:
    from accelerate import Accelerator

    _first_step(Accelerator, device)


def raw_fn(rank: int, device: str, workers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ["LOCAL_RANK"] = str(rank)
    if device == "cuda":
        torch.cuda.set_device(rank)
    where = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=workers)
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


def _launch(name: str, device: str, workers: int) -> None:
    if name == "raw fork":
        from torch.multiprocessing import start_processes

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
        start_processes(raw_fn, args=(device, workers), nprocs=workers, start_method="fork")
    elif name.startswith("notebook_accel"):
        from notebook_accel.launch.launcher import run_plan
        from notebook_accel.launch.observers import ConsoleObserver
        from notebook_accel.launch.preflight import plan_launch

        # single_in_process=False: one GPU still gets a forked worker.
        plan = plan_launch(
            function=ours_fn,
            args=(device,),
            num_processes=workers,
            backend=device,
            single_in_process=False,
            warm=name == "notebook_accel",
        )
        run_plan(plan, ConsoleObserver(plan.output))
    else:
        from accelerate import notebook_launcher

        notebook_launcher(
            accelerate_fn, args=(device,), num_processes=workers, use_port=str(_free_port())
        )


def child(name: str, device: str, workers: int, pause: float) -> None:
    """One interpreter: LAUNCHES launches of one launcher; prints their times as JSON."""
    global STEPPED
    warnings.simplefilter("ignore")
    import torch  # noqa: F401 - a notebook has torch imported before its first launch

    STEPPED = multiprocessing.Array("d", workers, lock=False)
    times, reports = [], []
    for launch in range(LAUNCHES):
        if launch:
            time.sleep(pause)
        for rank in range(workers):
            STEPPED[rank] = 0.0
        started = time.time()
        _launch(name, device, workers)
        if not all(STEPPED):
            raise RuntimeError(f"{name}: a worker never took its step")
        times.append(max(STEPPED) - started)
        if name.startswith("notebook_accel"):
            from notebook_accel import last_run

            # Not waited for: a launch that comes before warming ends waits for
            # it at the fork, and that wait is part of its time.
            reports.append(last_run())
    warming = [report.warming.seconds for report in reports if report.warming.wait(60)]
    print(json.dumps({"times": times, "warming": warming}))


def _run_child(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", name, "--device", args.device]
    command += ["--workers", str(args.workers), "--pause", str(args.pause)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout}\n{done.stderr}")
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
    parser.add_argument("--pause", type=float, default=5.0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers is None:
        args.workers = 2 if args.device == "cpu" else _gpu_count()
    if args.workers < 1:
        raise SystemExit("--device cuda: this machine has no GPU that torch can see")
    if args.child:
        child(args.child, args.device, args.workers, args.pause)
        return
    names = _launchers(args)
    samples: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:  # taking turns spreads the machine's load over all of them
            samples[name].append(_run_child(name, args))
    _print_table(samples, args)


def _gpu_count() -> int:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda._device_count_nvml()


def _print_table(samples: dict[str, list[dict]], args: argparse.Namespace) -> None:
    medians = {
        name: [statistics.median(run["times"][i] for run in runs) for i in range(LAUNCHES)]
        for name, runs in samples.items()
    }
    print(
        f"\n{args.workers} {args.device} worker(s), call -> first step in every worker, "
        f"median of {args.rounds} fresh interpreters, {args.pause:g} s between launches\n"
    )
    print("| launcher | " + " | ".join(f"launch {i + 1} (s)" for i in range(LAUNCHES)) + " |")
    print("|---|" + "---|" * LAUNCHES)
    for name, row in medians.items():
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in row) + " |")
    ours = medians["notebook_accel"]
    for reference in ("accelerate", "raw fork"):
        if reference in medians:
            ratios = [o / r for o, r in zip(ours, medians[reference], strict=True)]
            print(
                f"\nnotebook_accel / {reference}: "
                + ", ".join(f"launch {i + 1} {x:.2f}x" for i, x in enumerate(ratios))
            )
    if "accelerate" in medians:
        print("(goal: launches 2-3 at most 0.2x accelerate; launch 1 no slower than before)")
    if args.device == "cuda":
        print(f"GPU worker from a warm kernel: {max(ours[1:]):.3f} s to its first step (goal: 1 s)")
    off = medians["notebook_accel warm=False"][0]
    print(f"launch 1, warming on / off (off: as before warming existed): {ours[0] / off:.2f}x")
    if "accelerate" in medians:
        print(f"launch 1 with warm=False / accelerate: {off / medians['accelerate'][0]:.2f}x")
    warming = [run["warming"] for run in samples["notebook_accel"]]
    per_launch = [statistics.median(w[i] for w in warming) for i in range(LAUNCHES)]
    print(
        "kernel-side warming after each launch (s, background): "
        + ", ".join(f"{w:.2f}" for w in per_launch)
    )


if __name__ == "__main__":
    main()
