"""What a user with only `pip install notebook_accel` (and a torch) does, in that environment.

Run by tests/torch_range/test_torch_range.py with an environment's own python, this
checkout on PYTHONPATH and nothing else: no test tools, no extras, none of the dev
dependencies. Each step prints one line, "OK <step>" or "FAILED <step>: <error>", and
the last line is "RESULT" and a JSON object: the torch it ran, whether numpy imports,
and each step's outcome. Exit status 0 when every step passed.

Steps: save_state/load_state on 2 workers with exact resume (the run resumed from a
checkpoint ends bit for bit where the uninterrupted run ends), the demo, live workers,
and a launch from a real Jupyter kernel (ipykernel and jupyter_client come with the
package).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

STEPS, SAVE_AT = 6, 3


def train(directory: str, resume: bool) -> list[float]:
    """Steps SAVE_AT.. of a small Adam run on 2 workers; the uninterrupted run saves its
    state after SAVE_AT steps, the resumed one starts from that checkpoint."""
    import torch

    from notebook_accel import Accelerator, set_seed

    set_seed(0)
    accelerator = Accelerator()
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    batches = [torch.randn(16, 8, generator=generator) for _ in range(STEPS)]
    first = SAVE_AT if resume else 0
    if resume:
        accelerator.load_state(directory)
    losses = []
    for step in range(first, STEPS):
        if step == SAVE_AT and not resume:
            accelerator.save_state(directory)
        loss = model(batches[step].to(accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step >= SAVE_AT:
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def exact_resume(workdir: Path) -> str:
    from notebook_accel import notebook_launcher

    directory = str(workdir / "checkpoint")
    straight = notebook_launcher(train, args=(directory, False), num_processes=2, backend="cpu")
    resumed = notebook_launcher(train, args=(directory, True), num_processes=2, backend="cpu")
    assert resumed == straight, f"resumed {resumed} != uninterrupted {straight}"
    return f"{len(resumed)} steps after load_state equal to the uninterrupted run's"


def demo(workdir: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "notebook_accel.demo", "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=workdir,
    )
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    return done.stdout.strip().splitlines()[-1]


def live_workers(workdir: Path) -> str:
    from notebook_accel import start_workers

    workers = start_workers(2, backend="cpu", live=False)
    try:
        answers = workers.run_cell(
            "import torch, torch.distributed as dist\n"
            "value = torch.tensor([dist.get_rank() + 1.0])\n"
            "dist.all_reduce(value)\n"
            "value.item()",
            return_all=True,
        )
    finally:
        workers.close()
    assert answers == [3.0, 3.0], answers
    return f"2 workers answered {answers}"


KERNEL_CELL = """
import torch, torch.distributed as dist
from notebook_accel import notebook_launcher

def reduce_ranks():
    dist.init_process_group("gloo")
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return value.item()

print("LAUNCHED", notebook_launcher(reduce_ranks, num_processes=2, backend="cpu"))
"""


def kernel_launch(workdir: Path) -> str:
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", cwd=str(workdir))
    try:
        printed = []
        reply = client.execute_interactive(
            KERNEL_CELL,
            timeout=240,
            output_hook=lambda message: printed.append(message["content"].get("text", "")),
        )
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = "".join(printed)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "LAUNCHED 3.0" in text, text
    return "the kernel's launch returned 3.0"


def main() -> int:
    import torch

    try:
        import numpy  # noqa: F401

        has_numpy = True
    except ImportError:
        has_numpy = False
    outcomes = {}
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary)
        for step in (exact_resume, demo, live_workers, kernel_launch):
            try:
                said = step(workdir)
                outcomes[step.__name__] = "ok"
                print(f"OK {step.__name__}: {said}", flush=True)
            except Exception as error:  # noqa: BLE001 - each step's outcome is reported
                outcomes[step.__name__] = f"{type(error).__name__}: {error}"
                print(f"FAILED {step.__name__}: {traceback.format_exc()}", flush=True)
    result = {"torch": torch.__version__, "numpy": has_numpy, "steps": outcomes}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if all(outcome == "ok" for outcome in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
