"""Detached runs in real Jupyter kernels, as a notebook user meets them: the kernel that
started the run is killed or restarted mid-run, and a new kernel attaches: it gets the
output, the result (bit for bit that of the same run not detached) or the error with the
cell's line, and can stop the run."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from notebook_accel.launch.runs.directory import find_run
from notebook_accel.launch.runs.local import LocalRun
from tests_support import PROMPTLY, reply_to

pytestmark = pytest.mark.usefixtures("runs_dir")

TRAIN = """
import os, time, torch
from notebook_accel import Accelerator, notebook_launcher, attach, runs

def train(steps, pause=0.25, fail_rank=None, hold_at=None, until=None):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(steps):
        batch = torch.Generator().manual_seed(100 * step + accelerator.process_index)
        loss = model(torch.randn(8, 4, generator=batch)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        print(f"step {step}", flush=True)
        if step == 3 and accelerator.process_index == fail_rank:
            raise ValueError("rank 1 found a bad batch")
        deadline = time.monotonic() + 300
        while step == hold_at and not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.05)  # held until the test says (a file), however slow the machine
        time.sleep(pause)
    return accelerator.unwrap_model(model).weight.detach().clone()
"""


class Kernel:
    """A real kernel with its client; `close()` shuts it down (a dead one too)."""

    def __init__(self) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3")

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = PROMPTLY) -> str:
        """What the cell printed (its streams, its error's traceback)."""
        return self.run_showing(code, timeout)[0]

    def run_showing(self, code: str, timeout: float = PROMPTLY) -> tuple[str, list[dict]]:
        """What the cell printed, and what it displayed (each display's data)."""
        text, displays = [], []
        msg_id = self.client.execute(code)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not finish: {''.join(text)}"
            message = self.client.get_iopub_msg(timeout=left)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind == "error":
                text.append("\n".join(content["traceback"]))
            elif kind == "display_data":
                displays.append(content["data"])
            elif kind == "status" and content["execution_state"] == "idle":
                reply_to(self.client, msg_id, timeout)
                return "".join(text), displays

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernels():
    started: list[Kernel] = []

    def start() -> Kernel:
        started.append(Kernel())
        return started[-1]

    yield start
    for kernel in started:
        kernel.close()


def run_ids(text: str) -> list[str]:
    return [word for word in text.split() if word.count("-") == 2 and len(word) == 22]


def wait_for_line(run_id: str, line: str) -> None:
    run = LocalRun(find_run(run_id))
    deadline = time.monotonic() + PROMPTLY
    while line not in run.output():
        assert time.monotonic() < deadline, f"run {run_id} did not print {line!r}"
        time.sleep(0.1)


def test_a_killed_kernel_s_runs_go_on_and_a_new_kernel_gets_them_whole(kernels, tmp_path):
    # The long run holds at step 10 until the second kernel has listed it: "running" is
    # then what it is, not a race between its 30 steps and a kernel's start.
    release = tmp_path / "release"
    first = kernels()
    text, displays = first.run_showing(
        TRAIN
        + "two = dict(num_processes=2, backend='cpu', detach=True)\n"
        + f"hold = {{'hold_at': 10, 'until': {str(release)!r}}}\n"
        + "long_run = notebook_launcher(train, (30,), kwargs=hold, **two)\n"
        + "short_run = notebook_launcher(train, (3,), **two)\n"
        + "print(long_run.id, short_run.id)"
    )
    long_id, short_id = run_ids(text) or [text, ""]
    # Each run's live view is under the cell that started it, not under a later one.
    assert ["application/vnd.jupyter.widget-view+json" in data for data in displays] == [
        True,
        True,
    ]
    wait_for_line(long_id, "step 5")
    os.kill(first.pid, signal.SIGKILL)  # as the system's OOM killer ends a kernel
    psutil.Process(first.pid).wait(PROMPTLY)
    assert find_run(long_id).state() == "running"
    deadline = time.monotonic() + PROMPTLY  # the short run goes on to its end, too
    while find_run(short_id).state() != "finished" and time.monotonic() < deadline:
        time.sleep(0.1)

    second = kernels()
    text = second.run(
        TRAIN + f"print(runs())\nopen({str(release)!r}, 'w').close()\n"
        f"detached = attach('{long_id}')"
    )
    assert f"{long_id}  running" in text and f"{short_id}  finished" in text
    for rank_prefix in ("", "[rank 1] "):
        shown = [line for line in text.splitlines() if line.startswith(f"{rank_prefix}step ")]
        assert shown == [f"{rank_prefix}step {step}" for step in range(30)], text
    text = second.run(
        "reference = notebook_launcher(train, (30, 0.0), num_processes=2, backend='cpu')\n"
        "print('bit for bit:', torch.equal(detached, reference))\n"
        f"print('after the end:', attach('{short_id}').shape)"
    )
    assert "bit for bit: True" in text
    assert "after the end: torch.Size([1, 4])" in text
    assert "[rank 1] step 2" in text  # a finished run's output, replayed whole


def test_after_a_restart_a_new_kernel_gets_the_error_and_stops_the_other_run(kernels):
    first = kernels()
    text = first.run(
        TRAIN
        + "two = dict(num_processes=2, backend='cpu', detach=True)\n"
        + "failing = notebook_launcher(train, (30, 0.5), kwargs={'fail_rank': 1}, **two)\n"
        + "endless = notebook_launcher(train, (100000,), **two)\n"
        + "print(failing.id, endless.id)"
    )
    failing_id, endless_id = run_ids(text) or [text, ""]
    wait_for_line(endless_id, "step 1")
    endless = find_run(endless_id)
    workers = psutil.Process(endless.keeper().pid).children(recursive=True)
    first.manager.restart_kernel(now=True)  # ends the kernel's whole process group
    first.client.wait_for_ready(timeout=PROMPTLY)

    text = first.run(f"from notebook_accel import attach\nattach('{failing_id}')")
    assert "WorkerError" in text and "worker rank 1 raised ValueError" in text
    assert 'raise ValueError("rank 1 found a bad batch")' in text  # the cell's line
    text = first.run(
        f"run = attach('{endless_id}', wait=False)\nrun.stop()\nprint('now', run.state)"
    )
    assert "now stopped" in text
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == [], "a worker outlived the stop"
    assert endless.keeper() is None
