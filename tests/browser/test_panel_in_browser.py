"""The control panel in a real JupyterLab in Chromium: choose, launch, watch, stop."""

from __future__ import annotations

import re

import pytest

from browser_harness import (
    outputs,
    run_notebook_in_lab,
    screenshot,
    wait_for_text,
    write_notebook,
)
from tests_support import PROMPTLY

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CELLS = [
    """
import os, time, torch
from notebook_accel import Accelerator, panel, progress_bar

def train(steps, seconds_per_step):
    accelerator = Accelerator()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    print(f"rank {accelerator.process_index} trains in {accelerator.mixed_precision}")
    for step in progress_bar(range(steps)):
        with accelerator.autocast():
            loss = model(torch.randn(16, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        time.sleep(seconds_per_step)
    return {"precision": accelerator.mixed_precision, "dtype": str(loss.dtype)}

quick = panel(train, args=(30, 0.02))
quick
""",
    """
slow = panel(train, args=(100000, 0.05))
slow
""",
]


def panel_number(page, index: int):
    return outputs(page).locator(".notebook-accel-panel").nth(index)


def test_launch_with_bf16_from_the_panel_then_stop_a_long_run(lab_server, page):
    write_notebook(lab_server, "panel.ipynb", CELLS)
    run_notebook_in_lab(page, lab_server, "panel.ipynb")
    quick, slow = panel_number(page, 0), panel_number(page, 1)

    # Choose as a person would: 2 processes, bf16; fp8 is greyed out on a CPU.
    processes = quick.locator(".notebook-accel-processes input")
    processes.fill("2")
    processes.press("Enter")
    fp8 = quick.locator(".notebook-accel-precision-fp8 button, button.notebook-accel-precision-fp8")
    assert fp8.first.is_disabled()
    quick.locator("button.notebook-accel-precision-bf16").click()
    quick.locator("button.notebook-accel-launch").click()

    outcome = quick.locator(".notebook-accel-outcome")
    outcome.filter(has_text="finished").wait_for(timeout=90_000)
    # The status comes from the run's last event; the result box once the launch has
    # returned, a moment later.
    result = quick.locator(".notebook-accel-result")
    result.filter(has_text="Result").wait_for(timeout=PROMPTLY * 1000)
    assert "'precision': 'bf16'" in result.inner_text()
    logs = quick.locator(".notebook-accel-logs").inner_text()
    assert "rank 0 trains in bf16" in logs and "[rank 1] rank 1 trains in bf16" in logs
    chart = quick.locator("svg.notebook-accel-chart polyline")
    assert chart.is_visible()
    assert quick.locator("svg.notebook-accel-chart").get_attribute("aria-label") == "loss"
    assert len(quick.locator(".notebook-accel-rank[data-status=finished]").all()) == 2
    # The progress line follows the run to its end, as the outcome does.
    progress = quick.locator(".notebook-accel-progress")
    progress.filter(has_text="finished at step 30/30").wait_for(timeout=10_000)
    screenshot(page, "panel-finished", locator=quick)

    # A long run: launch, see it running, stop it, launch again.
    slow.locator("button.notebook-accel-launch").click()
    slow.locator(".notebook-accel-rank[data-status=running]").first.wait_for(timeout=30_000)
    wait_for_text(page, re.compile(r"step \d+/100000"), timeout=30)
    slow.locator("button.notebook-accel-stop").click()
    # The run has 100,000 steps to go: only the stop ends it within the wait.
    stopped = slow.locator(".notebook-accel-outcome").filter(has_text="stopped")
    stopped.wait_for(timeout=PROMPTLY * 1000)
    terminated = slow.locator(".notebook-accel-result").filter(has_text="Stopped")
    terminated.wait_for(timeout=PROMPTLY * 1000)
    assert "every worker was terminated" in terminated.inner_text()
    stopped_at = re.compile(r"stopped at step \d+/100000")
    slow.locator(".notebook-accel-progress").filter(has_text=stopped_at).wait_for(timeout=10_000)
    screenshot(page, "panel-stopped", locator=slow)
    slow.locator("button.notebook-accel-launch").click()
    slow.locator(".notebook-accel-outcome").filter(has_text="running").wait_for(timeout=30_000)
    slow.locator("button.notebook-accel-stop").click()
    slow.locator(".notebook-accel-outcome").filter(has_text="stopped").wait_for(timeout=10_000)
