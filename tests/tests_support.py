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


# Ports a test names come from below the kernel's ephemeral range (where binding port
# 0 and outgoing connections draw from), from a block this test process holds alone
# (a lock on the block's file, held until the process ends): no other process of this
# suite, or of another pytest run beside it, can take a port between a test choosing
# it and a server listening on it. Ray's workers take 10002-19999 by default, so the
# blocks start above.
_PORT_BLOCKS_START = 20000
_PORT_BLOCK_SIZE = 500
_held_block: range | None = None
_next_in_block = 0


def _port_block() -> range:
    import fcntl
    import os
    import tempfile

    global _held_block
    if _held_block is not None:
        return _held_block
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_start = int(ranges.read().split()[0])
    directory = os.path.join(tempfile.gettempdir(), "notebook-accel-test-ports")
    os.makedirs(directory, exist_ok=True)
    for start in range(
        _PORT_BLOCKS_START, ephemeral_start - _PORT_BLOCK_SIZE + 1, _PORT_BLOCK_SIZE
    ):
        lock = open(os.path.join(directory, f"{start}.lock"), "w")  # noqa: SIM115 - held for life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _port_block.lock = lock  # type: ignore[attr-defined] - kept open: the hold
        _held_block = range(start, start + _PORT_BLOCK_SIZE)
        return _held_block
    raise RuntimeError(
        f"every block of test ports below the ephemeral range ({ephemeral_start}) is held "
        "by another test process"
    )


def suite_port() -> int:
    """A port for a test that must name one before a server listens on it: this
    process's own (see above), never handed out twice by it, and free now (a port a
    program beside the suite holds is passed over)."""
    import socket

    global _next_in_block
    block = _port_block()
    for _ in block:
        port = block[_next_in_block % len(block)]
        _next_in_block += 1
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port in {block} is taken")


class closed_port:  # noqa: N801 - used as a function: `with closed_port() as port:`
    """A port that provably stays closed while the block runs: it is bound here and
    never listened on, so nothing else can listen there and a connection is refused."""

    def __enter__(self) -> int:
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        return self._socket.getsockname()[1]

    def __exit__(self, *exc_info: object) -> None:
        self._socket.close()


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


from types import ModuleType  # noqa: E402

# Set by `make test` (the Makefile's test target, which CI runs): there a dev dependency
# that cannot be imported is a broken install, and fails the tests that need it.
ENV_REQUIRE_DEV_DEPENDENCIES = "REQUIRE_DEV_DEPENDENCIES"


def dev_dependency(module: str) -> ModuleType:
    """Import and return `module`, which a package of pyproject.toml's dev extra provides.

    Where it cannot be imported, the test (or, called at a module's top, the whole file)
    skips, or fails when $REQUIRE_DEV_DEPENDENCIES is 1. Only for dev dependencies:
    what the dev extra does not bring (torch_xla, a GPU) may be missing anywhere.
    """
    import importlib
    import os

    try:
        return importlib.import_module(module)
    except ImportError as error:
        reason = (
            f"{module} cannot be imported ({error}); it is a dev dependency: "
            "pip install -e '.[dev]'"
        )
    # Out of the except block: the report is the reason alone, not the import's traceback.
    if os.environ.get(ENV_REQUIRE_DEV_DEPENDENCIES) == "1":
        pytest.fail(f"{ENV_REQUIRE_DEV_DEPENDENCIES}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def press_stop() -> None:
    """The notebook's stop button: SIGINT to this process, from the main thread, where the
    launch runs and its handler lives. `signal.raise_signal` runs the Python handler before
    it returns, so the press lands where it is made, never after the run it was meant for
    (a timer's press can arrive once the launch has ended, and end the test session)."""
    import signal
    import threading

    assert threading.current_thread() is threading.main_thread(), "a press from another thread"
    signal.raise_signal(signal.SIGINT)


class WhenPrinted:
    """A run observer (`observers=[...]`, `workers.add_observer`) that calls `action()` once
    `ranks` workers have each printed the line `line`, and again for the next `times - 1`
    rounds of it: an action (a stop press, a kill) at a known point of the run, taken in the
    thread that runs it. `done` counts the actions taken."""

    def __init__(
        self, line: str, action: Callable[[], None], ranks: int = 2, times: int = 1
    ) -> None:
        self.line, self.action, self.ranks, self.times = line, action, ranks, times
        self.done = 0
        self._seen: set[int] = set()

    def on_event(self, event: object, report: object) -> None:
        from notebook_accel.reporting.events import OutputLine

        if self.done == self.times or not isinstance(event, OutputLine):
            return
        if event.line.rstrip("\n") != self.line:
            return
        self._seen.add(event.rank)
        if len(self._seen) == self.ranks:
            self._seen = set()
            self.done += 1
            self.action()
