"""Warm launches in a real Jupyter kernel, cells run back to back as "Run All" does:
the kernel stays sound, and warming never runs beside a cell."""

from __future__ import annotations

import pytest

from tests_support import cell_text, execute_cells

TRAIN = """
import sys, threading, torch
from notebook_accel import Accelerator, last_run, notebook_launcher

def train():
    import sys, torch
    found = "torch._dynamo" in sys.modules
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    return found
"""

RUN_ALL = [
    TRAIN,
    """
found = notebook_launcher(train, num_processes=2, backend="cpu", live=False)
print("FIRST", found, last_run().warming.status)
""",
    """
model = torch.nn.Linear(4, 2)  # the kernel's own optimizer, right after the launch
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
print("KERNEL OK")
""",
    """
print("SECOND", notebook_launcher(train, num_processes=2, backend="cpu", live=False))
""",
    """
# A launch from another thread, as the panel's Launch button makes: its imports
# wait for the kernel's event loop, after this cell.
def imports_wave():
    import wave

reports = []
def launch():
    notebook_launcher(imports_wave, num_processes=2, backend="cpu", live=False)
    reports.append(last_run())

thread = threading.Thread(target=launch)
thread.start()
thread.join(60)
print("THREAD", reports[0].warming.status, "wave" in sys.modules)
""",
    """
print("NEXT CELL", reports[0].warming.wait(30), reports[0].warming.status, "wave" in sys.modules)
""",
]


def test_run_all_launch_then_kernel_optimizer_then_launch(tmp_path):
    notebook = execute_cells(RUN_ALL, tmp_path, timeout=120)
    assert "FIRST False deferred" in cell_text(notebook.cells[1])
    assert "KERNEL OK" in cell_text(notebook.cells[2])
    assert "SECOND True" in cell_text(notebook.cells[3])
    assert "THREAD deferred False" in cell_text(notebook.cells[4])
    assert "NEXT CELL True done True" in cell_text(notebook.cells[5])
    for cell in notebook.cells:
        assert not [out for out in cell.outputs if out.get("name") == "stderr"], cell.outputs


PANEL = [
    """
import sys
from notebook_accel import LaunchPanel

def train():
    pass

panel = LaunchPanel(train)
panel
""",
    """
print("WARMED", panel.warming.wait(60), panel.warming.status, "torch._dynamo" in sys.modules)
""",
]


@pytest.mark.timeout(180)
def test_a_panel_shown_warms_after_its_cell(tmp_path):
    notebook = execute_cells(PANEL, tmp_path, timeout=120)
    assert "WARMED True done True" in cell_text(notebook.cells[1])
