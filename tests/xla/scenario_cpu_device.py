"""A launch on XLA's CPU device, run by test_xla_cpu_device.py in the torch_xla environment.

With PJRT_DEVICE=CPU and CPU_NUM_DEVICES=1, notebook_launcher forks one
worker that becomes a PJRT process. Each step prints one JSON line that the
test reads; a step that goes wrong raises, so the script exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from notebook_accel import Accelerator, WorkerError, last_run, notebook_launcher

STEPS = 8
# The launch that never ends: stopped this many seconds after it started.
TIMEOUT = 6


def make_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    inputs = torch.randn(STEPS * 8, 4)
    targets = inputs.sum(dim=1, keepdim=True)
    return model, torch.utils.data.TensorDataset(inputs, targets)


def reference_weights() -> torch.Tensor:
    """The same training in plain PyTorch on the CPU: what the XLA run must reproduce."""
    model, dataset = make_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in torch.utils.data.DataLoader(dataset, batch_size=8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def train(checkpoint_dir: str) -> dict:
    accelerator = Accelerator()
    model, dataset = make_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    devices = set()
    for step, (x, y) in enumerate(loader):
        devices.add(str(x.device))
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss}, step=step)
    predictions = accelerator.gather_for_metrics(model(x).detach())
    total = accelerator.reduce(torch.tensor([2.0], device=accelerator.device), "sum")
    accelerator.wait_for_everyone()
    weights = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()

    # xm.save through the platform's hook: written on the main process, read on the CPU.
    path = os.path.join(checkpoint_dir, "model.pt")
    if accelerator.is_main_process:
        accelerator.state.platform.save(model.state_dict(), path)
    accelerator.wait_for_everyone()
    saved = torch.load(path, map_location="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    model.load_state_dict(saved)
    reloaded = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    saved_on = sorted({str(tensor.device) for tensor in saved.values()})

    # Accelerator.save_state/load_state, where the checkpoint module handles XLA.
    save_state = "absent"
    if hasattr(accelerator, "save_state"):
        try:
            accelerator.save_state(os.path.join(checkpoint_dir, "state"))
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.zero_()
            accelerator.load_state(os.path.join(checkpoint_dir, "state"))
            after = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
            save_state = "exact" if torch.equal(after, weights) else "differs"
        except Exception as error:  # noqa: BLE001 - reported to the test
            save_state = f"{type(error).__name__}: {error}"
    print("trained on", accelerator.device, flush=True)
    return {
        "devices": sorted(devices),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "predictions": tuple(predictions.shape),
        "reduced": float(total.item()),
        "weights": weights,
        "reloaded": reloaded,
        "saved_on": saved_on,
        "save_state": save_state,
    }


def bf16_step() -> str:
    accelerator = Accelerator()  # picks up mixed_precision="bf16" from the launch
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with accelerator.autocast():
        inner = torch.nn.Linear(4, 4).to(accelerator.device)(torch.ones(2, 4, device="xla"))
    out = model(torch.ones(2, 4, device=accelerator.device))
    return f"{accelerator.mixed_precision} {inner.dtype} {out.dtype}"


def fails() -> None:
    accelerator = Accelerator()
    torch.ones(2, device=accelerator.device).sum().item()
    raise ValueError("this worker fails on purpose")


def device_sum() -> float:
    accelerator = Accelerator()
    return torch.ones(2, device=accelerator.device).sum().item()


def hangs() -> None:
    accelerator = Accelerator()
    torch.ones(2, device=accelerator.device).sum().item()
    time.sleep(600)


def report(name: str, **values) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


def main() -> None:
    launch = {"backend": "xla", "num_processes": 1, "live": False}
    # A backward pass in the launching process before the fork, as a notebook
    # that tried its model on the CPU first does (pytorch/xla#4174).
    expected = reference_weights()

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        result = notebook_launcher(train, args=(checkpoint_dir,), **launch)
    run = last_run()
    report(
        "train",
        seconds=round(time.monotonic() - started, 1),
        devices=result["devices"],
        distributed_type=result["distributed_type"],
        num_processes=result["num_processes"],
        predictions=result["predictions"],
        reduced=result["reduced"],
        matches_cpu=bool(torch.allclose(result["weights"], expected, atol=1e-5)),
        max_difference=float((result["weights"] - expected).abs().max()),
        reload_exact=bool(torch.equal(result["weights"], result["reloaded"])),
        saved_on=result["saved_on"],
        save_state=result["save_state"],
        losses=len(run.history("loss")),
        status=run.status,
        backend=run.backend,
    )

    report("bf16", result=notebook_launcher(bf16_step, mixed_precision="bf16", **launch))

    try:
        notebook_launcher(fails, **launch)
    except WorkerError as error:
        report(
            "failure",
            rank=error.rank,
            traceback_has_cause="this worker fails on purpose" in error.traceback,
            traceback_names_function="in fails" in error.traceback,
            message=str(error).splitlines()[0],
        )

    started = time.monotonic()
    try:
        notebook_launcher(hangs, timeout=TIMEOUT, **launch)
    except TimeoutError:
        report("timeout", seconds=round(time.monotonic() - started, 1), limit=TIMEOUT)

    # Touching an XLA device here, in the launching process, starts the runtime:
    # a forked worker could no longer use it, so a launch that must fork is
    # refused before anything starts, and the default forks it from a clean template
    # process (on this CPU device; a TPU, held by this process, would be refused too).
    import torch_xla

    torch.ones(1, device=torch_xla.device()).sum().item()
    try:
        notebook_launcher(fails, start_method="fork", **launch)
    except RuntimeError as error:
        report("refused", message=str(error))
    value = notebook_launcher(device_sum, **launch)
    report("fresh", value=value, start_method=last_run().start_method)


if __name__ == "__main__":
    main()
    sys.exit(0)
