"""Workers that are not forked from a real Jupyter kernel (forked from a clean process
started once, or each a fresh interpreter): a cell's function, class and globals reach
them, values come back as the kernel's own classes, errors keep their traceback, and the
line that started CUDA is named."""

from __future__ import annotations

import pytest

from tests_support import cell_text, execute_cells


def cells(runtime_dir: str, method: str) -> list[str]:
    return [
        f"""
import os, subprocess, sys, torch
os.environ["NOTEBOOK_ACCEL_RUNTIME_DIR"] = {runtime_dir!r}
METHOD = {method!r}
from notebook_accel import Accelerator, WorkerError, last_run, notebook_launcher
""",
        """
class Scaled:
    def __init__(self, value):
        self.value = value

def double(x):
    return 2 * x

factor = 5

def train(model):
    accelerator = Accelerator()
    model = accelerator.prepare(model)
    total = accelerator.reduce(torch.tensor([float(double(factor))]), "sum")
    print("worker", accelerator.process_index, "has", type(model).__name__, flush=True)
    return Scaled(total.item())

result = notebook_launcher(
    train, args=(torch.nn.Linear(4, 2),), num_processes=2, backend="cpu", start_method=METHOD
)
print("RESULT", isinstance(result, Scaled), result.value, last_run().start_method)
""",
        """
def fails():
    raise ValueError("a fresh worker says no")

try:
    notebook_launcher(fails, num_processes=2, backend="cpu", start_method=METHOD)
except WorkerError as error:
    print("CAUGHT", error.rank)
    print(error.traceback)
""",
        """
import notebook_accel.platforms.cuda_origin as cuda_origin

class FakeCuda:  # this kernel may have no GPU: a stand-in for torch.cuda
    started = False
    def is_initialized(self):
        return self.started
    def _lazy_init(self):
        self.started = True

fake = FakeCuda()
cuda_origin._wrap(fake)
""",
        "fake._lazy_init()",
        """
print("ORIGIN", cuda_origin.origin().describe())
report = subprocess.run(
    [sys.executable, "-m", "notebook_accel.cli", "env"], capture_output=True, text=True
).stdout
print("ENV", [line for line in report.splitlines() if f"pid {os.getpid()}" in line])
cuda_origin.forget()
""",
    ]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_not_forked_from_the_kernel(tmp_path, method):
    notebook = execute_cells(cells(str(tmp_path / "runtime"), method), tmp_path, timeout=120)
    launched, failed, _, _, named = (notebook.cells[i] for i in (1, 2, 3, 4, 5))
    text = cell_text(launched)
    assert f"RESULT True 20.0 {method}" in text
    assert "worker 0 has DistributedDataParallel" in text
    assert "[rank 1] worker 1 has DistributedDataParallel" in text
    failure = cell_text(failed)
    assert "CAUGHT 0" in failure or "CAUGHT 1" in failure
    assert "ValueError: a fresh worker says no" in failure
    assert 'raise ValueError("a fresh worker says no")' in failure  # the cell's own line
    origin = cell_text(named)
    assert "ORIGIN at cell In[5], line 1: fake._lazy_init()" in origin
    assert "cell In[5], line 1: fake._lazy_init()" in origin.split("ENV", 1)[1]
