"""Two launches at once (a panel's in a thread, a cell's meanwhile) keep separate reports."""

from __future__ import annotations

import threading
import time

import pytest

from notebook_accel import Accelerator, last_run, notebook_launcher
from notebook_accel.launch.launcher import run_plan
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.reporting.observers import RunObserver

# Each run keeps its report in the launching process, whatever starts its workers; two
# threads starting workers at once under every start method: tests/launch/test_launch_stress.py.
pytestmark = pytest.mark.usefixtures("each_way_to_ship")


def logs_as(tag: str, steps: int, pause: float) -> str:
    accelerator = Accelerator()
    for step in range(steps):
        accelerator.log({"tag": tag, "loss": float(step)}, step=step)
        time.sleep(pause)
    return tag


class ReportsSeen(RunObserver):
    def __init__(self) -> None:
        self.reports: set[int] = set()

    def on_event(self, event, report) -> None:
        self.reports.add(id(report))


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_panel_style_run_and_a_cell_run_each_keep_their_own_report():
    plan = plan_launch(
        function=logs_as,
        args=("panel", 40, 0.1),
        num_processes=2,
        backend="cpu",
        single_in_process=False,
    )
    panel_report = plan.new_report()
    seen = ReportsSeen()
    returned = {}

    def panel_run() -> None:
        returned["panel"] = run_plan(plan, seen, report=panel_report)

    thread = threading.Thread(target=panel_run, name="panel-style-run", daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: len(panel_report.metrics) >= 2, 30), panel_report.status
        # A cell's launch while the panel's goes: in this process, so its metrics
        # travel through this process's destination, not a worker's channel.
        assert (
            notebook_launcher(logs_as, args=("cell", 3, 0.0), num_processes=1, backend="cpu")
            == "cell"
        )
        cell_report = last_run()
        assert panel_report.status == "running"  # the two really overlapped
    finally:
        thread.join(60)
    assert not thread.is_alive() and returned["panel"] == "panel"

    assert cell_report is not panel_report
    assert last_run() is cell_report  # the most recently started launch
    assert panel_report.status == cell_report.status == "finished"
    assert [r.values["tag"] for r in panel_report.metrics] == ["panel"] * 40
    assert [r.values["tag"] for r in cell_report.metrics] == ["cell"] * 3
    assert panel_report.results == {0: "panel"} and cell_report.results == {0: "cell"}
    assert seen.reports == {id(panel_report)}
