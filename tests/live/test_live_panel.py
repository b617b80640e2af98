"""The panel attached to live workers: it shows their metrics and logs, and its Stop
interrupts the running call while the workers stay up."""

from __future__ import annotations

import threading
import time

import pytest

from notebook_accel.live import start_workers
from notebook_accel.platforms import Hardware
from notebook_accel.ui.panel import LaunchPanel
from tests_support import PROMPTLY

CPU_ONLY = Hardware(gpus=(), cpu_cores=2, ram_bytes=1 << 30)

LOG_CELL = """
from notebook_accel import Accelerator
accelerator = Accelerator()
for step in range(1, 6):
    accelerator.log({"loss": 1.0 / step}, step=step)
print("logged", accelerator.process_index)
"""


def nap(seconds):
    time.sleep(seconds)
    return "woke"


@pytest.fixture
def workers():
    group = start_workers(2, backend="cpu", live=False)
    yield group
    group.close()


def test_an_attached_panel_shows_the_group_and_stops_its_call(workers):
    panel = LaunchPanel(lambda: None, hardware=CPU_ONLY)
    panel.attach(workers)
    assert panel.running and panel.launch_button.disabled and not panel.stop_button.disabled
    workers.run_cell(LOG_CELL)
    assert "loss" in panel.run_widgets.metrics.value
    assert "logged 0" in panel.run_widgets.logs.value
    assert "<svg" in panel.run_widgets.chart.value

    outcome = {}

    def call_in_a_thread():
        try:
            outcome["value"] = workers.run(nap, 600)
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome["error"] = error

    thread = threading.Thread(target=call_in_a_thread)
    thread.start()
    time.sleep(0.5)
    panel.stop()
    thread.join(PROMPTLY)  # the call naps for 600 s
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), KeyboardInterrupt), outcome
    assert workers.alive and workers.run(nap, 0) == "woke"

    workers.close()
    panel.stop()  # the group is gone: the panel lets go of it
    assert not panel.running and not panel.launch_button.disabled
