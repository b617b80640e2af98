"""The launcher inside a real Jupyter kernel: results, cell output, errors, interrupts."""

from __future__ import annotations

import time

import psutil

from tests_support import PROMPTLY, cell_text, execute_cells, reply_once_idle, run_in_kernel

CELLS = [
    """
import os, torch, torch.distributed as dist
from notebook_accel import notebook_launcher, WorkerError
torch.set_num_threads(2)
_ = torch.randn(800, 800) @ torch.randn(800, 800)  # the kernel's OpenMP pool is now busy
""",
    """
def train(scale):
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(value)
    _ = torch.randn(300, 300) @ torch.randn(300, 300)
    print(f"rank {dist.get_rank()} reduced {value.item()}")
    return value

result = notebook_launcher(train, args=(2.0,), num_processes=2, timeout=60, backend="cpu")
assert result.item() == 6.0, result
print("RESULT", result.item())
""",
    """
def fails():
    if int(os.environ["RANK"]) == 1:
        raise ZeroDivisionError("rank one divided by zero")
    dist.init_process_group("gloo")
    dist.barrier()

try:
    notebook_launcher(fails, num_processes=2, backend="cpu")
except WorkerError as error:
    print("CAUGHT", error.rank, type(error).__mro__[1].__name__)
    print(error.traceback)
""",
]


def test_notebook_launch_returns_results_shows_output_and_reports_errors(tmp_path):
    notebook = execute_cells(CELLS, tmp_path)
    launch, failure = notebook.cells[1], notebook.cells[2]
    text = cell_text(launch)
    assert "RESULT 6.0" in text
    assert "rank 0 reduced 6.0\n" in text
    assert "[rank 1] rank 1 reduced 6.0\n" in text
    failure_text = cell_text(failure)
    assert "CAUGHT 1 RuntimeError" in failure_text
    assert "ZeroDivisionError: rank one divided by zero" in failure_text


def run(client, code: str) -> dict:
    """Execute code (no stdin, as before); the reply content and the text the cell printed."""
    return run_in_kernel(client, code, allow_stdin=False, timeout=60)


def test_the_stop_button_stops_workers_and_the_next_launch_works(kernel):
    manager, client = kernel
    kernel_process = psutil.Process(manager.provisioner.process.pid)
    setup = run(
        client,
        "import signal, time\n"
        "from notebook_accel import notebook_launcher\n"
        "before = signal.getsignal(signal.SIGINT)\n"
        "def sleepy(s):\n    time.sleep(s)\n    return 'woke'\n",
    )
    assert setup["reply"]["status"] == "ok"
    msg_id = client.execute(
        "notebook_launcher(sleepy, args=(600,), num_processes=2, backend='cpu')"
    )
    # Two workers and the launch's janitor (launch/forking.py).
    deadline = time.monotonic() + 30
    while len(kernel_process.children()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kernel_process.children()) == 3
    time.sleep(0.5)
    manager.interrupt_kernel()
    interrupted_at = time.monotonic()
    reply = reply_once_idle(client, msg_id, timeout=PROMPTLY)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted_at < PROMPTLY  # the workers sleep for 600 s
    assert [
        p for p in kernel_process.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
    ] == []
    after = run(
        client,
        "print(signal.getsignal(signal.SIGINT) is before)\n"
        "print(notebook_launcher(sleepy, args=(0,), num_processes=2, backend='cpu'))",
    )
    assert after["reply"]["status"] == "ok", after
    assert after["text"].split() == ["True", "woke"]
