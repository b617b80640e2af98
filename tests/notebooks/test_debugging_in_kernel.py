"""Debugging a run from the cell in a real Jupyter kernel: a worker's breakpoint() and
post-mortem debugger prompt through Jupyter's stdin requests, which this test answers
as a frontend does; a frontend without stdin, and the stop button at a prompt."""

from __future__ import annotations

import time

import psutil
import pytest

from tests_support import PROMPTLY, reply_once_idle
from tests_support import run_in_kernel as run

pytestmark = pytest.mark.timeout(180)

SETUP = """
import torch
from notebook_accel import Accelerator, WorkerError, notebook_launcher, start_workers

def stops_on_rank_one():
    accelerator = Accelerator()
    secret = torch.tensor([1.0, 2.0]) * (accelerator.process_index + 1)
    if accelerator.process_index == 1:
        breakpoint()
    return accelerator.gather(secret).tolist()

def fails_deep_inside(limit):
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        window = [0.5, 0.25][:limit]
        return window[limit]
    accelerator.wait_for_everyone()
"""


def test_a_breakpoint_and_a_post_mortem_prompt_in_the_cell(kernel):
    _, client = kernel
    assert run(client, SETUP)["reply"]["status"] == "ok"

    stopped = run(
        client,
        "print(notebook_launcher(stops_on_rank_one, num_processes=2, backend='cpu'))",
        answers=["p secret", "secret[0] = 7", "c"],
    )
    assert stopped["reply"]["status"] == "ok", stopped
    assert stopped["prompts"] == ["[rank 1] (Pdb) "] * 3
    assert "[rank 1] tensor([2., 4.])" in stopped["text"]
    assert "[1.0, 2.0, 7.0, 4.0]" in stopped["text"]

    failed = run(
        client,
        "try:\n"
        "    notebook_launcher(fails_deep_inside, args=(2,), num_processes=2, backend='cpu',\n"
        "                      post_mortem=True)\n"
        "except WorkerError as error:\n"
        "    print('CAUGHT', error.rank)",
        answers=["p window", "p limit + 40", "q"],
    )
    assert failed["reply"]["status"] == "ok", failed
    assert failed["prompts"] == ["[rank 1] (Pdb) "] * 3
    assert "post-mortem debugger" in failed["text"]
    assert "[rank 1] [0.5, 0.25]" in failed["text"] and "[rank 1] 42" in failed["text"]
    assert "CAUGHT 1" in failed["text"]


def test_a_frontend_without_stdin_passes_the_breakpoint_and_says_why(kernel):
    _, client = kernel
    assert run(client, SETUP)["reply"]["status"] == "ok"
    done = run(
        client,
        "print(notebook_launcher(stops_on_rank_one, num_processes=2, backend='cpu'))",
        allow_stdin=False,
    )
    assert done["reply"]["status"] == "ok", done
    assert done["prompts"] == []
    assert "debugger not opened: this frontend cannot answer input" in done["text"]
    assert "[1.0, 2.0, 2.0, 4.0]" in done["text"]


def test_stop_pressed_at_a_prompt_stops_the_run_and_leaves_no_worker(kernel):
    manager, client = kernel
    kernel_process = psutil.Process(manager.provisioner.process.pid)
    assert run(client, SETUP)["reply"]["status"] == "ok"
    msg_id = client.execute(
        "notebook_launcher(stops_on_rank_one, num_processes=2, backend='cpu')", allow_stdin=True
    )
    request = client.get_stdin_msg(timeout=60)
    assert request["content"]["prompt"] == "[rank 1] (Pdb) "
    manager.interrupt_kernel()
    reply = reply_once_idle(client, msg_id, timeout=PROMPTLY)
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [
            child
            for child in kernel_process.children(recursive=True)
            if child.status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive


def test_live_workers_debug_the_last_failed_call_and_stay_up(kernel):
    _, client = kernel
    assert run(client, SETUP)["reply"]["status"] == "ok"
    started = run(client, "workers = start_workers(num_processes=2, backend='cpu')")
    assert started["reply"]["status"] == "ok", started
    try:
        failed = run(
            client,
            "def step(n):\n"
            "    steps = [1, 2, 3]\n"
            "    return steps[n] if Accelerator().process_index == 1 else 0\n"
            "try:\n"
            "    workers.run(step, 5)\n"
            "except WorkerError as error:\n"
            "    print('CAUGHT', error.rank)",
        )
        assert "CAUGHT 1" in failed["text"], failed
        debugged = run(client, "workers.debug()", answers=["p steps", "p n * 2", "c"])
        assert debugged["reply"]["status"] == "ok", debugged
        assert debugged["prompts"] == ["[rank 1] (Pdb) "] * 3
        assert "[rank 1] [1, 2, 3]" in debugged["text"] and "[rank 1] 10" in debugged["text"]
        after = run(client, "print('AFTER', workers.run(lambda: 5))")
        assert "AFTER 5" in after["text"], after
    finally:
        run(client, "workers.close()")
