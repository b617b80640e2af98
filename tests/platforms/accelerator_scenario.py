"""Scenarios on the test accelerator, each run as a kernel would run it: in a process
of its own that imports the device package, then launches real workers.

`python accelerator_scenario.py NAME` prints one JSON line of what it saw; the
tests (test_accelerator_platform.py) check it. A process of its own, because
importing the device makes it this process's accelerator for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import testaccel  # noqa: F401 - registers the "testaccel" device with torch
import torch
from torch import nn

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.launch.running import last_run
from notebook_accel.platforms import detect_hardware, platform_for_process


def error_of(call, *args, **kwargs) -> str:
    try:
        call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    return ""


# -- where each rank runs --------------------------------------------------------


def where_am_i():
    accelerator = Accelerator()
    seen = torch.ones(1, device=accelerator.device)
    gathered = accelerator.gather_for_metrics(
        torch.tensor([accelerator.process_index], device=accelerator.device)
    )
    return {
        "rank": accelerator.process_index,
        "device": str(accelerator.device),
        "current_index": torch.accelerator.current_device_index(),
        "tensor": str(seen.device),
        "distributed_type": str(accelerator.distributed_type),
        "backend": torch.distributed.get_backend(),
        "gathered": gathered.cpu().tolist(),
        "platform": accelerator.state.platform.name,
    }


def placement() -> dict:
    hardware = detect_hardware()
    untouched = plan_launch(function=where_am_i, num_processes=2).start_method
    out = {
        "untouched_start": untouched,
        "accelerator": hardware.accelerator,
        "count": hardware.accelerators.count,
        "precisions": list(hardware.accelerators.precisions),
        "in_kernel": str(Accelerator().device),
        "process_platform": platform_for_process().name,
        "four": notebook_launcher(where_am_i, num_processes=4, return_all=True),
        "peak_bytes": [r.get("peak_gpu_bytes") for r in last_run().resources.values()],
        "chosen": notebook_launcher(where_am_i, devices=[1, 3], return_all=True),
        "too_many": error_of(plan_launch, function=where_am_i, num_processes=5),
        "fp16": error_of(plan_launch, function=where_am_i, mixed_precision="fp16"),
    }
    # Once the kernel has used the device, forked workers could not: they start from
    # a clean process, and still train on their own devices.
    torch.ones(1, device="testaccel:0")
    plan = plan_launch(function=where_am_i, num_processes=2)
    out["touched_start"] = plan.start_method
    out["touched_reason"] = plan.fresh_start_reason
    out["touched_run"] = notebook_launcher(where_am_i, num_processes=2, return_all=True)
    out["forced_fork"] = error_of(
        plan_launch, function=where_am_i, num_processes=2, start_method="fork"
    )
    return out


# -- DDP on the device, bit for bit as on CPU workers ----------------------------


def train_ddp(steps: int = 6):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(steps):
        inputs = torch.randn(4, 8, generator=data).to(accelerator.device)
        loss = model(inputs).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    # Nine samples over two ranks: the padding rank 1 gets is dropped again.
    loader = torch.utils.data.DataLoader(torch.arange(9.0), batch_size=2)
    loader = accelerator.prepare(loader)
    seen = torch.cat([accelerator.gather_for_metrics(batch) for batch in loader])
    weights = [p.detach().cpu() for p in accelerator.unwrap_model(model).parameters()]
    return {
        "weights": weights,
        "seen": sorted(seen.cpu().tolist()),
        "wrapped": type(model).__name__,
        "device": str(accelerator.device),
    }


def ddp() -> dict:
    on_device = notebook_launcher(train_ddp, num_processes=2)
    on_cpu = notebook_launcher(train_ddp, num_processes=2, backend="cpu")
    return {
        "device": on_device["device"],
        "wrapped": on_device["wrapped"],
        "seen": on_device["seen"],
        "identical": all(
            torch.equal(a, b) for a, b in zip(on_device["weights"], on_cpu["weights"], strict=True)
        ),
        "moved": not torch.equal(on_device["weights"][0], on_cpu["weights"][0] * 0),
    }


# -- save_state / load_state: exact resume with the device's generators ----------


def train_with_dropout(folder: str, resume: bool, steps: int = 6, save_at: int = 3):
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    start = 0
    if resume:
        accelerator.load_state(folder)
        start = save_at
    losses = []
    for step in range(start, steps):
        inputs = torch.full((4, 8), float(step), device=accelerator.device)
        noise = torch.randn(4, 1, device=accelerator.device)  # the device's generator
        with accelerator.autocast():
            output = model(inputs)  # handed back in fp32, as Accelerate does
            dtype = str(torch.mm(inputs, inputs.T).dtype)
        loss = (output.float() - noise).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if not resume and step + 1 == save_at:
            accelerator.save_state(folder)
    states = torch.load(
        os.path.join(folder, f"random_states_{accelerator.process_index}.pkl"),
        weights_only=False,
    )
    return {"losses": losses, "autocast_dtype": dtype, "rng_keys": sorted(states)}


def resume() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        whole = notebook_launcher(train_with_dropout, args=(folder, False), num_processes=2)
        resumed = notebook_launcher(train_with_dropout, args=(folder, True), num_processes=2)
    return {"whole": whole, "resumed": resumed}


# -- big models: a device map over the devices, a pipeline over two ---------------


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).eval()


def _pipelined(inputs):
    from notebook_accel.big_modeling import prepare_pippy

    model = prepare_pippy(_blocks(), split_points=["2"], example_args=(inputs,), gather_output=True)
    accelerator = Accelerator()
    return model(inputs).cpu(), str(accelerator.device)


def big_model() -> dict:
    from notebook_accel.big_modeling import dispatch_model, get_max_memory, infer_auto_device_map

    layer = 64 * 64 * 4 + 64 * 4
    inputs = torch.randn(3, 64)
    with torch.no_grad():
        expected = _blocks()(inputs)
    budget = {index: int(layer * (2.2 if index == 0 else 1.5)) for index in range(4)}
    device_map = infer_auto_device_map(_blocks(), max_memory={**budget, "cpu": 1 << 30})
    model = dispatch_model(_blocks(), device_map)
    with torch.no_grad():
        output = model(inputs.to("testaccel:0"))
    pipelined, stage_devices = notebook_launcher(_pipelined, args=(inputs,), num_processes=2)
    return {
        "device_map": {key: str(value) for key, value in device_map.items()},
        "weights_on": [str(block.weight.device) for block in model],
        "equal": torch.allclose(output.cpu(), expected),
        "free_by_index": [str(key) for key in get_max_memory()],
        "pipelined_equal": torch.allclose(pipelined, expected, atol=1e-6),
        "bad_index": error_of(dispatch_model, _blocks(), {"": 7}),
    }


# -- live workers, the panel and `notebook-accel env` -----------------------------


def live_panel_env() -> dict:
    from notebook_accel.live import start_workers
    from notebook_accel.ui.panel import LaunchPanel

    group = start_workers(2, live=False)
    try:
        devices = group.run(lambda: str(Accelerator().device), return_all=True)
        total = group.run_cell(
            "import torch\nt = torch.ones(2, device=Accelerator().device)\nstr(t.device)",
            return_all=True,
        )
    finally:
        group.close()
    panel = LaunchPanel(lambda: None)
    env = subprocess.run(
        [sys.executable, "-m", "notebook_accel.cli", "env"],
        env={**os.environ, "NOTEBOOK_ACCEL_DEVICE_PACKAGE": "testaccel"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return {
        "live": devices,
        "cell": total,
        "backends": list(panel.backend.options),
        "boxes": [box.description for box in panel.gpu_boxes],
        "env": env,
    }


SCENARIOS = {
    "placement": placement,
    "ddp": ddp,
    "resume": resume,
    "big_model": big_model,
    "live_panel_env": live_panel_env,
}


if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
