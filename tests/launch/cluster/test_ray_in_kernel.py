"""Launches on the Ray cluster from a real Jupyter kernel, as a notebook user makes them: the
workers' output in the cell, the stop button, cells run again, a kernel restart."""

from __future__ import annotations

import time

from cluster_support import ours_still_running, wait_until_nothing_is_left
from tests_support import PROMPTLY, reply_to


def send(client, code: str) -> str:
    return client.execute(code)


def outputs(client, msg_id: str, timeout: float, until: str | None = None) -> dict:
    """The cell's printed text and its reply (or, with `until`, the text once it appears)."""
    text: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        message = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "stream":
            text.append(message["content"]["text"])
            if until is not None and until in "".join(text):
                return {"text": "".join(text)}
        if message["msg_type"] == "error":
            text.append("\n".join(message["content"]["traceback"]))
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    reply = reply_to(client, msg_id, timeout)
    return {"reply": reply["content"], "text": "".join(text)}


def run(client, code: str, timeout: float = 120) -> dict:
    return outputs(client, send(client, code), timeout)


SETUP = """
import time, torch
from notebook_accel import Accelerator, WorkerError, notebook_launcher
ON_CLUSTER = dict(cluster="ray", ray_address=ADDRESS, num_processes=2,
                  placement_strategy="STRICT_SPREAD")

def hello(greeting):
    accelerator = Accelerator()
    total = accelerator.reduce(torch.ones(1))
    print(f"{greeting} from rank {accelerator.process_index}: {total.item():g} workers")
    return accelerator.process_index

def forever():
    accelerator = Accelerator()
    step = 0
    while True:
        accelerator.reduce(torch.ones(1))
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.05)

def breaks():
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise KeyError("no such column")
"""


def setup(cluster) -> str:
    return SETUP.replace("ADDRESS", repr(cluster.address))


def test_output_stop_cells_run_again_and_a_restart_in_a_real_kernel(ray_cluster, kernel):
    # One kernel for all of it: each new kernel imports torch and joins the cluster again.
    manager, client = kernel
    assert run(client, setup(ray_cluster))["reply"]["status"] == "ok"

    first = run(client, "print(notebook_launcher(hello, ('hello',), **ON_CLUSTER))")
    assert first["reply"]["status"] == "ok", first["text"]
    assert "hello from rank 0: 2 workers\n" in first["text"]
    assert "[rank 1] hello from rank 1: 2 workers\n" in first["text"]
    assert "pid=" not in first["text"] and "NodeAgent" not in first["text"]
    assert first["text"].rstrip().endswith("0")

    # A loop of launches in one cell, then the same cell again: warm, nothing "already connected".
    loop = "for i in range(3):\n    notebook_launcher(hello, (f'loop {i}',), **ON_CLUSTER)"
    for _ in range(2):
        again = run(client, loop)
        assert again["reply"]["status"] == "ok", again["text"]
        assert "[rank 1] loop 2 from rank 1: 2 workers\n" in again["text"]

    failed = run(client, "notebook_launcher(breaks, **ON_CLUSTER)")
    assert failed["reply"].get("ename") == "WorkerError", failed
    assert "worker rank 1 on node 127.0.0.1 (" in failed["text"]
    assert 'raise KeyError("no such column")' in failed["text"]  # the cell's own line

    # The stop button in the middle of a step: everything on the cluster freed within 5 s.
    msg_id = send(client, "notebook_launcher(forever, **ON_CLUSTER)")
    outputs(client, msg_id, timeout=60, until="[rank 1] step 5")
    manager.interrupt_kernel()
    pressed = time.monotonic()
    stopped = outputs(client, msg_id, timeout=PROMPTLY)
    assert stopped["reply"].get("ename") == "KeyboardInterrupt", stopped
    assert wait_until_nothing_is_left(ray_cluster) == []
    assert time.monotonic() - pressed < PROMPTLY  # the run steps forever
    after = run(client, "print(notebook_launcher(hello, ('after',), **ON_CLUSTER))")
    assert "[rank 1] after from rank 1: 2 workers\n" in after["text"]

    # A kernel restart leaves no agent, warm ones included, and the new kernel launches.
    warm = run(client, "notebook_launcher(hello, ('warm',), keep_warm=600, **ON_CLUSTER)")
    assert warm["reply"]["status"] == "ok"
    assert ours_still_running(ray_cluster) != []  # the agents wait, warm, for the next launch
    manager.restart_kernel(now=True)
    client.wait_for_ready(timeout=60)
    # The kernel's Ray job ended with it: Ray removes its agents and placement group.
    assert wait_until_nothing_is_left(ray_cluster) == []
    assert run(client, setup(ray_cluster))["reply"]["status"] == "ok"
    again = run(client, "print(notebook_launcher(hello, ('again',), **ON_CLUSTER))")
    assert "[rank 1] again from rank 1: 2 workers\n" in again["text"]
