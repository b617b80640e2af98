"""Every CUDA check in one run, printed as JSON: run on a machine with GPUs.

    python tests/gpu/cuda_scenario.py        # what tests/gpu/test_cuda.py reads

It runs as its own process so that CUDA starts untouched, as in a fresh
notebook kernel. With one GPU the launches still fork a worker (as the
panel does), since that is what must work.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def train(precision_steps: int = 20) -> dict:
    import torch

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(accelerator.process_index)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen_dtype = {}

    def note_dtype(module, inputs, output):  # returns None: the output stays as it is
        seen_dtype.setdefault("dtype", str(output.dtype))

    accelerator.unwrap_model(model)[0].register_forward_hook(note_dtype)
    for _ in range(precision_steps):
        inputs = torch.randn(64, 256, device=accelerator.device)
        targets = torch.randint(0, 10, (64,), device=accelerator.device)
        with accelerator.autocast():
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    total = accelerator.reduce(torch.ones(1, device=accelerator.device))
    return {
        "pid": __import__("os").getpid(),
        "device": str(accelerator.device),
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "precision": accelerator.mixed_precision,
        "layer_dtype": seen_dtype.get("dtype"),
        "reduced": total.item(),
        "loss": loss.item(),
    }


def train_given(model) -> dict:
    """The notebook flow: a model the kernel loaded on its GPU, trained on every GPU."""
    import os

    import torch

    from notebook_accel import Accelerator

    received_on = str(next(model.parameters()).device)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = model(torch.randn(8, 256, device=accelerator.device)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    return {"received_on": received_on, "device": str(accelerator.device), "pid": os.getpid()}


def launch(precision: str, function=train, args: tuple = (), **options) -> dict:
    import warnings

    from notebook_accel import detect_hardware, last_run
    from notebook_accel.launch.launcher import run_plan
    from notebook_accel.launch.preflight import plan_launch
    from notebook_accel.reporting.observers import ConsoleObserver

    gpus = len(detect_hardware().gpus)
    started = time.perf_counter()
    plan = plan_launch(
        function=function,
        args=args,
        num_processes=min(gpus, 2),
        mixed_precision=precision,
        backend="cuda",
        single_in_process=False,
        timeout=300,
        **options,
    )
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = run_plan(plan, ConsoleObserver())
    return {
        **result,
        "seconds": time.perf_counter() - started,
        "resources": {str(k): v for k, v in last_run().resources.items()},
        "start_method": last_run().start_method,
        "fresh_start_reason": plan.fresh_start_reason,
        "warnings": [str(w.message) for w in warned],
    }


def evaluate_then_train() -> dict:
    """Load and evaluate in this process on the GPU, then train on every GPU."""
    import torch

    model = torch.nn.Linear(256, 10).to("cuda")  # what a notebook cell does
    with torch.no_grad():
        model(torch.randn(4, 256, device="cuda"))
    return launch("bf16", function=train_given, args=(model,))


def in_kernel() -> dict:
    import os

    from notebook_accel import notebook_launcher

    result = notebook_launcher(train, num_processes=1, backend="cuda", live=False)
    return {**result, "pid_is_kernel": result.get("pid", os.getpid()) == os.getpid()}


def warming_after_launches() -> dict:
    """What this process imported after the forked launches, and that CUDA stayed untouched."""
    from notebook_accel import last_run
    from notebook_accel.platforms import LaunchRefused, platform_named

    warming = last_run().warming
    finished = warming.wait(120)
    try:
        platform_named("cuda").check_parent_is_clean()
        clean = True
    except LaunchRefused:
        clean = False
    return {
        "finished": finished,
        "status": warming.status,
        "problem": warming.problem,
        "skipped": sorted(warming.skipped),
        "dynamo_here": "torch._dynamo" in sys.modules,
        "cuda_clean_after_warming": clean,
    }


def attempt(name: str, fn, results: dict) -> None:
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as error:  # noqa: BLE001 - reported to the test
        results[name] = {
            "ok": False,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }


def main() -> None:
    import torch

    from notebook_accel import detect_hardware

    hardware = detect_hardware()
    results: dict = {
        "gpus": [[g.name, g.memory_bytes, g.capability] for g in hardware.gpus],
        "cuda_initialized_after_detect": torch.cuda.is_initialized(),
    }
    for precision in ("no", "fp16", "bf16", "fp8"):
        attempt(precision, lambda p=precision: launch(p), results)
    results["cuda_initialized_after_launches"] = torch.cuda.is_initialized()
    results["warming"] = warming_after_launches()

    # num_processes=1 runs in this process (the debugger-friendly path); it starts
    # CUDA here, so it comes after every forked launch.
    attempt("in_kernel", in_kernel, results)

    # CUDA is running here now, as after a cell that evaluated a model on the GPU:
    # launches fork their workers from a clean template process, and a forced fork
    # is refused.
    attempt("after_cuda_init", evaluate_then_train, results)
    attempt("fork_after_cuda_init", lambda: launch("no", start_method="fork"), results)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
