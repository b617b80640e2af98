"""Live workers in a real kernel, as a notebook user drives them: a cell that ends in the
prepared model, a rank that fails while its peer waits in DDP's all-reduce, a worker
killed between cells. Each shows what happened in its own cell and, unless a worker
died, the group goes on with its state."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from tests_support import PROMPTLY, cell_text

CELLS = [
    """
import os, signal, time
from notebook_accel import start_workers

workers = start_workers(2, backend="cpu")
""",
    """
%%on_workers
import torch
from notebook_accel import Accelerator

torch.manual_seed(0)
accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.randn(16, 4)
steps = 0

def train_step():
    global steps
    if accelerator.process_index == 1 and steps == 1:
        raise ValueError("bad batch on rank 1")
    loss = model(data).square().mean()
    accelerator.backward(loss)  # rank 0 waits here for rank 1
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    return steps
""",
    """
%%on_workers
model
""",
    """
%%on_workers
train_step()
""",
    """
started = time.monotonic()
try:
    workers.run_cell("train_step()")
finally:
    print(f"answered after {time.monotonic() - started:.2f} s")
""",
    """
%%on_workers --all
steps
""",
    """
pids = workers.run(os.getpid, return_all=True)
os.kill(pids[1], signal.SIGKILL)
time.sleep(1)
""",
    """
%%on_workers
steps
""",
    """
workers.restart()
workers.run_cell("'a new group'")
""",
    "workers.close()",
]


def outputs_text(cell) -> str:
    """Everything the cell showed: streams, its value, its error."""
    parts = [cell_text(cell)]
    for output in cell.outputs:
        parts.append(output.get("data", {}).get("text/plain", ""))
        if output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "\n".join(parts)


def test_live_workers_survive_what_a_notebook_user_does(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in CELLS]
    NotebookClient(
        notebook,
        timeout=90,
        kernel_name="python3",
        allow_errors=True,  # a failing cell shows its error, as it does for a user
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    _, _, shown, first_step, failed, after, _, killed, restarted, _ = notebook.cells
    errors = [
        index
        for index, cell in enumerate(notebook.cells)
        if any(output.output_type == "error" for output in cell.outputs)
    ]
    assert errors == [4, 7], [outputs_text(cell) for cell in notebook.cells]

    # A cell that ends in the DDP model shows the model, marked as shown by the worker.
    text = outputs_text(shown)
    assert "# repr on worker rank 0" in text
    assert "DistributedDataParallel(\n  (module): Linear(in_features=4" in text
    assert outputs_text(first_step).strip().endswith("1")

    # Rank 1 raised while rank 0 waited in DDP's all-reduce: rank 1's error, at once.
    text = outputs_text(failed)
    assert "WorkerError: worker rank 1 raised ValueError: bad batch on rank 1" in text
    assert "process group was formed again" in text
    seconds = float(text.split("answered after ")[1].split(" s")[0])
    assert seconds < PROMPTLY, text  # not a collective's timeout (bench/live_failure.py)
    assert "[1, 1]" in outputs_text(after)  # the state went on, on both ranks

    # A worker killed between cells: named at the next cell, with the way out.
    text = outputs_text(killed)
    assert "WorkerError: worker rank 1 was killed by SIGKILL" in text
    assert "workers.restart()" in text
    assert "'a new group'" in outputs_text(restarted)


def _executed(cells: list[str], folder) -> nbformat.NotebookNode:
    """A notebook of `cells`, run back to back in a real kernel started in `folder`."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in cells]
    NotebookClient(
        notebook, timeout=90, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    ).execute()
    return notebook


DEFINITION_CELLS = [
    """
import torch
from notebook_accel import start_workers

workers = start_workers(2, backend="cpu", live=False)
""",
    """
%%on_workers
import torch
weights = torch.ones(2)  # resident on the workers
""",
    """
weights = torch.zeros(2)  # the kernel's own, of the same name
factor = 3

def scaled():
    return weights * factor

def total():
    return float(scaled().sum())

workers.run(total)
""",
    """
def scaled():  # edited: the next call must use this one
    return weights * factor * 10

workers.run(total)
""",
    """
class Counter:
    def bump(self):
        global bumps
        bumps = bumps + 1 if "bumps" in globals() else 1
        return bumps

def bump_twice():
    Counter().bump()
    return Counter().bump()

workers.run(bump_twice), workers.run(bump_twice)
""",
    """
%%on_workers --all
(total(), bumps)
""",
    "workers.close()",
]


def test_helpers_and_classes_from_the_notebook_see_the_workers_names_and_their_edits(tmp_path):
    """A function a call uses (not only the one called) reads the workers' names, and
    an edited definition replaces the one the workers had from an earlier call."""
    notebook = _executed(DEFINITION_CELLS, tmp_path)
    _, _, first, edited, bumped, on_workers, _ = notebook.cells
    assert outputs_text(first).strip() == "6.0"  # the workers' ones, not the kernel's zeros
    assert outputs_text(edited).strip() == "60.0"
    assert outputs_text(bumped).strip() == "(2, 4)"  # a method's global lands on the worker
    assert outputs_text(on_workers).strip() == "[(60.0, 4), (60.0, 4)]"


CHANGED_VALUE_CELLS = [
    """
import torch
from notebook_accel import start_workers

workers = start_workers(2, backend="cpu", live=False)
lr = 0.1
model = torch.nn.Linear(2, 1, bias=False)

def read():
    return lr, float(model.weight.detach().sum())

def train():
    with torch.no_grad():
        model.weight.fill_(7.0)  # trained on the workers, in place

workers.run(train)
workers.run(read)
""",
    "lr = 0.001  # the user edits the cell and runs it again\nworkers.run(read)",
    "%%on_workers\nlr = 5.0  # the workers' own value",
    "lr = 0.5\nworkers.run(read)",
    "model = torch.nn.Linear(2, 1, bias=False)  # a new one\nworkers.run(read)[1] != 14.0",
    "workers.close()",
]


def test_a_value_the_kernel_changes_reaches_the_workers_but_not_over_their_own(tmp_path):
    """`lr = ...` edited in the kernel reaches the workers at the next call; a value a
    worker set itself stays; a model trained in place on the workers stays until the
    kernel makes a new one."""
    notebook = _executed(CHANGED_VALUE_CELLS, tmp_path)
    trained, edited, _, own, replaced, _ = notebook.cells
    assert outputs_text(trained).strip() == "(0.1, 14.0)"  # not the kernel's untrained copy
    assert outputs_text(edited).strip() == "(0.001, 14.0)"
    assert outputs_text(own).strip() == "(5.0, 14.0)"
    assert outputs_text(replaced).strip() == "True"
