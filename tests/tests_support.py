"""Helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest

# "At once", in a correctness test: far longer than a stop, a failure report or a
# timeout takes on a loaded machine (a fresh interpreter alone can take seconds
# there), far shorter than what the run would otherwise wait for (its workers' 600 s
# sleep, a collective's timeout). How fast these are is measured in bench/, as ratios.
PROMPTLY = 60.0

# The start methods a test runs under (tests/conftest.py): under every one for what
# depends on how a worker's process starts, is watched, signalled and ends; under the two
# ways to ship the function for what a worker does once it runs, which is the same code
# under "spawn" as under "forkserver".
EACH_START = pytest.mark.usefixtures("each_start_method")
SHIPPED = pytest.mark.usefixtures("each_way_to_ship")

# This process's descendants when the running test began (set by tests/conftest.py):
# what a test checks for "nothing left" is what it started, never what an earlier
# test or another program beside the suite left running.
_present_at_test_start: set[int] = set()


def mark_test_start() -> set[int]:
    """Remember the descendants alive now as the running test's starting point."""
    global _present_at_test_start
    _present_at_test_start = {child.pid for child in _descendants()}
    return set(_present_at_test_start)


def _descendants() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.Error:
            pass
    return alive


def live_children() -> list[psutil.Process]:
    """This process's descendants that the running test started and that still run
    (zombies excluded).

    The template process of start method "forkserver" (launch/template.py) lasts
    from one launch to the next on purpose: it is left out (the workers it forked
    are not).
    """
    from notebook_accel.launch.template import template_status

    skip = template_status().pid
    return [
        child
        for child in _descendants()
        if child.pid != skip and child.pid not in _present_at_test_start
    ]


def run_together(commands: list[list[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Start every command at once and wait for all: (return code, stdout, stderr) each.

    Processes still running at the timeout are killed, so none is left behind.
    """
    import subprocess

    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return [
        (process.returncode, out, err)
        for process, (out, err) in zip(processes, outputs, strict=True)
    ]


def execute_cells(sources: list[str], directory, timeout: float = 90):
    """Run code cells top to bottom in a real Jupyter kernel; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in sources]
    NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(directory)}},
    ).execute()
    return notebook


def cell_text(cell) -> str:
    """The text a cell printed (its stream outputs)."""
    return "".join(output.get("text", "") for output in cell.outputs)


def free_port() -> int:
    """A port nothing listens on right now (for tests that must name one)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def open_fds_once_back_to(
    expected: set[int], seconds: float = 5.0, leaving_out: Callable[[], set[int]] = set
) -> set[int]:
    """This process's open descriptors, less those `leaving_out()` names, once they equal
    `expected`, or after `seconds` (a background thread, such as one importing modules
    after a run, may hold a file open for a moment)."""
    import os
    import time

    def now() -> set[int]:
        return {int(name) for name in os.listdir("/proc/self/fd")} - leaving_out()

    deadline = time.monotonic() + seconds
    while now() != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return now()


def reply_to(client, msg_id: str, timeout: float) -> dict:
    """The kernel's shell reply to the request `msg_id`. Replies to other requests are
    passed over: jupyter_client's `wait_for_ready` (and `start_new_kernel`) sends a new
    kernel_info request every second until one is answered, so a kernel slow to start
    on a loaded machine leaves the answers to the others waiting on the shell channel."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        reply = client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def reply_once_idle(client, msg_id: str, timeout: float) -> dict:
    """The reply to `msg_id` once the kernel is idle after it, as for a person who runs
    the next cell after this one ended: ipykernel aborts an execute request that reaches
    it between an error's reply and the end of that cell's handling (its stop-on-error
    window, ipython/ipykernel#609), which a client that sends at the error's reply can
    hit where another thread of the kernel holds the GIL (a launch's background imports)."""
    import time

    reply = reply_to(client, msg_id, timeout)
    deadline = time.monotonic() + timeout
    while True:
        message = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if (
            message["parent_header"].get("msg_id") == msg_id
            and message["msg_type"] == "status"
            and message["content"]["execution_state"] == "idle"
        ):
            return reply


def run_in_kernel(
    client, code: str, answers=(), allow_stdin: bool = True, timeout: float = 90
) -> dict:
    """Execute `code` in a kernel as a frontend would: each stdin request (its prompt
    recorded) gets the next of `answers` ("c" once they run out); return the reply
    content, the text the cell showed (its streams and error tracebacks) and the
    prompts."""
    import queue
    import time

    answers = list(answers)
    msg_id = client.execute(code, allow_stdin=allow_stdin)
    text, prompts = [], []
    deadline = time.monotonic() + timeout
    idle = False
    while not idle:
        assert time.monotonic() < deadline, f"the cell did not finish: {''.join(text)}"
        try:
            request = client.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            pass
        else:
            prompts.append(request["content"]["prompt"])
            client.input(answers.pop(0) if answers else "c")
        try:
            message = client.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "stream":
            text.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            text.append("\n".join(message["content"]["traceback"]))
        idle = message["msg_type"] == "status" and message["content"]["execution_state"] == "idle"
    reply = reply_to(client, msg_id, timeout)
    return {"reply": reply["content"], "text": "".join(text), "prompts": prompts}
