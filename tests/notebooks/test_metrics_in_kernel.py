"""In a real kernel, a launch that logs metrics shows a live view and keeps the history."""

from __future__ import annotations

from tests_support import cell_text, execute_cells

CELLS = [
    """
import time
from notebook_accel import Accelerator, notebook_launcher, last_run, progress_bar

def train(steps):
    accelerator = Accelerator()
    for step in progress_bar(range(steps)):
        accelerator.log({"loss": 1.0 / (step + 1), "accuracy": step / steps}, step=step)
        time.sleep(0.02)
    accelerator.print("trained", steps, "steps")
    return steps

notebook_launcher(train, args=(40,), num_processes=2, backend="cpu")
""",
    """
report = last_run()
print("STATUS", report.status)
print("RECORDS", len(report.metrics), "LAST", report.history("loss")[-1])
print("RANKS", sorted(report.resources))
""",
]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def test_live_view_and_history_in_a_kernel(tmp_path):
    notebook = execute_cells(CELLS, tmp_path)
    launch, summary = notebook.cells
    assert any(WIDGET_VIEW in output.get("data", {}) for output in launch.outputs)
    assert "trained 40 steps" in cell_text(launch)
    text = cell_text(summary)
    assert "STATUS finished" in text
    assert "RECORDS 40 LAST (39, 0.025)" in text
    assert "RANKS [0, 1]" in text

    models = notebook.metadata["widgets"][WIDGET_STATE]["state"].values()
    states = [model["state"] for model in models]
    bars = [s for s in states if s.get("_model_name") == "IntProgressModel"]
    assert any(s["value"] == s["max"] == 40 for s in bars)
    html = " ".join(str(s.get("value", "")) for s in states if s.get("_model_name") == "HTMLModel")
    assert "<polyline" in html and "loss" in html  # the curve
    assert "accuracy" in html  # the latest metrics
    assert "rank 1: finished" in html


LIVE_CALLS = [
    """
from notebook_accel import start_workers

workers = start_workers(2, backend="cpu")
""",
    """
%%on_workers
import time
from notebook_accel import Accelerator

accelerator = Accelerator()

def chat(call):
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        print(f"call {call} line {step}")
        time.sleep(0.3)  # a redraw of the view between lines
""",
    """
%%on_workers
chat(1)
""",
    """
%%on_workers
chat(2)
""",
    "workers.close()",
]


def test_each_call_of_live_workers_shows_its_own_output_per_rank(tmp_path):
    notebook = execute_cells(LIVE_CALLS, tmp_path)
    assert "call 2 line 2" in cell_text(notebook.cells[3])
    models = notebook.metadata["widgets"][WIDGET_STATE]["state"].values()
    panes = [
        str(model["state"].get("value", ""))
        for model in models
        if "notebook-accel-output-pane" in model["state"].get("_dom_classes", ())
    ]
    first = [pane for pane in panes if "call 1 line" in pane]
    second = [pane for pane in panes if "call 2 line" in pane]
    assert first and second  # a view under each call, with its ranks' lines
    # the group's report holds both calls; the second call's view shows its own
    assert not any("call 1 line" in pane for pane in second)
