"""The workers' output per rank in a real JupyterLab in Chromium: in the panel, and under
a launched cell while the cell still runs (the kernel busy, the browser filters)."""

from __future__ import annotations

import json
import time

import pytest

from browser_harness import (
    KERNEL_IDLE_TIMEOUT,
    LAB_LOAD_TIMEOUT,
    outputs,
    run_notebook_in_lab,
    screenshot,
    write_notebook,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHATTY = """
import os, sys, time
from notebook_accel import Accelerator, notebook_launcher, panel, progress_bar

def chatty(lines):
    rank = Accelerator().process_index
    for i in range(lines):
        if i % 10 == 9:
            print(f"rank {rank} warning {i}", file=sys.stderr, flush=True)
        else:
            print(f"rank {rank} line {i}", flush=True)
    return rank

def chatty_until(stop_file):
    accelerator = Accelerator()
    rank = accelerator.process_index
    for step in progress_bar(range(3000)):  # progress: the live view shows
        if os.path.exists(stop_file):
            break
        print(f"rank {rank} step {step}", flush=True)
        if step % 5 == 4:
            print(f"rank {rank} warning {step}", file=sys.stderr, flush=True)
        time.sleep(0.05)
    return rank
"""

# What the pane holds and what the browser shows of it, per rank.
_PANE_LINES = """(pane) => {
    const lines = Array.from(pane.querySelectorAll(".notebook-accel-line[data-rank]"));
    const count = (rank, visible) => lines.filter((line) => line.dataset.rank === rank
        && (!visible || line.checkVisibility())).length;
    return {drawn0: count("0", false), drawn1: count("1", false),
            shown0: count("0", true), shown1: count("1", true)};
}"""


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {seconds} s: {what}")
        time.sleep(0.2)


def check_stderr_marked(pane, count: int) -> None:
    marked = pane.locator(".notebook-accel-stderr")
    assert marked.count() == count
    assert all("warning" in text for text in marked.all_inner_texts())
    colour = marked.first.evaluate("(line) => getComputedStyle(line).backgroundColor")
    assert colour == "rgb(255, 221, 221)", colour


def test_the_panel_shows_one_rank_s_output_when_picked(lab_server, page):
    write_notebook(
        lab_server, "output.ipynb", [CHATTY, "control = panel(chatty, args=(300,))\ncontrol"]
    )
    run_notebook_in_lab(page, lab_server, "output.ipynb")
    control = outputs(page).locator(".notebook-accel-panel").first
    processes = control.locator(".notebook-accel-processes input")
    processes.fill("2")
    processes.press("Enter")
    control.locator("button.notebook-accel-launch").click()
    control.locator(".notebook-accel-outcome").filter(has_text="finished").wait_for(timeout=90_000)

    pane = control.locator(".notebook-accel-output-pane")
    wait_until(
        lambda: all(f"[rank {r}] rank {r} line 298" in pane.inner_text() for r in (0, 1)),
        10,
        "every rank's last lines, prefixed, in the pane",
    )
    assert "newest 500 lines" in control.locator(".notebook-accel-output-summary").inner_text()

    control.locator(".notebook-accel-rank-filter select").select_option(label="rank 1")
    wait_until(
        lambda: "rank 0" not in pane.inner_text() and "[rank" not in pane.inner_text(),
        10,
        "the pane still shows other ranks' lines",
    )  # the kernel drew rank 1's own lines, unprefixed
    lines = pane.inner_text().strip().splitlines()
    assert len(lines) == 300 and all(line.startswith("rank 1 ") for line in lines)
    assert lines[0] == "rank 1 line 0" and lines[-1] == "rank 1 warning 299"
    check_stderr_marked(pane, count=30)
    screenshot(page, "output-per-rank-panel", locator=control)


def test_eight_chatty_ranks_stay_bounded_and_one_is_picked(lab_server, page):
    """8 ranks of 400 lines each (3,200 lines, a tenth of them stderr): the pane draws
    the newest 500 at most, the filter offers every rank, and one rank's lines come alone."""
    write_notebook(
        lab_server, "output8.ipynb", [CHATTY, "control = panel(chatty, args=(400,))\ncontrol"]
    )
    run_notebook_in_lab(page, lab_server, "output8.ipynb")
    control = outputs(page).locator(".notebook-accel-panel").first
    processes = control.locator(".notebook-accel-processes input")
    processes.fill("8")
    processes.press("Enter")
    control.locator("button.notebook-accel-launch").click()
    control.locator(".notebook-accel-outcome").filter(has_text="finished").wait_for(timeout=150_000)

    pane = control.locator(".notebook-accel-output-pane")
    spans = pane.locator(".notebook-accel-line[data-rank]")
    wait_until(lambda: spans.count() == 500, 15, "the newest 500 lines drawn")
    options = control.locator(".notebook-accel-rank-filter select option").all_inner_texts()
    # ipywidgets writes an option's spaces as no-break spaces
    assert [option.replace("\xa0", " ") for option in options] == ["all"] + [
        f"rank {rank}" for rank in range(8)
    ]

    control.locator(".notebook-accel-rank-filter select").select_option(label="rank 7")
    wait_until(
        lambda: "[rank" not in pane.inner_text() and spans.count() == 400,
        15,
        "rank 7's 400 lines, alone",
    )
    lines = pane.inner_text().strip().splitlines()
    assert all(line.startswith("rank 7 ") for line in lines)
    assert lines[0] == "rank 7 line 0" and lines[-1] == "rank 7 warning 399"
    check_stderr_marked(pane, count=40)
    screenshot(page, "output-per-rank-eight", locator=control)


def start_all_cells(page, server, path: str) -> None:
    """Open the notebook and start running every cell, without waiting for them."""
    page.goto(f"{server.url}lab/tree/{path}?token={server.token}")
    page.wait_for_function(
        """(path) => {
            const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const kernel = widget && widget.context && widget.context.path === path
                && widget.sessionContext.session && widget.sessionContext.session.kernel;
            return kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
        }""",
        arg=path,
        timeout=(LAB_LOAD_TIMEOUT + KERNEL_IDLE_TIMEOUT) * 1000,
    )
    page.evaluate("""() => { window.jupyterapp.commands.execute("notebook:run-all-cells"); }""")


def test_under_a_running_cell_picking_a_rank_filters_at_once(lab_server, page):
    stop_file = "stop-the-workers"
    launch = f"notebook_launcher(chatty_until, args=({json.dumps(stop_file)},), num_processes=2)"
    write_notebook(lab_server, "live.ipynb", [CHATTY, launch])
    start_all_cells(page, lab_server, "live.ipynb")
    try:
        section = outputs(page).locator(".notebook-accel-output-section")
        section.wait_for(timeout=90_000)  # two ranks and progress: the section is there
        pane = section.locator(".notebook-accel-output-pane")
        assert not pane.is_visible()  # closed at first
        section.locator(".jupyter-widget-Collapse-header").first.click()
        pane.wait_for(state="visible")
        wait_until(
            lambda: min(pane.evaluate(_PANE_LINES)[key] for key in ("shown0", "shown1")) > 0,
            30,
            "both ranks' lines in the pane",
        )
        # The cell still runs: the kernel hears of the choice only once it is done, and
        # meanwhile draws every rank's lines; the browser hides rank 0's.
        outcome = outputs(page).locator(".notebook-accel-outcome").first
        section.locator(".notebook-accel-rank-filter select").select_option(label="rank 1")
        counts = pane.evaluate(_PANE_LINES)
        assert counts["drawn0"] > 0 and counts["shown0"] == 0 and counts["shown1"] > 0, counts
        assert outcome.inner_text() == "running"
        time.sleep(1.0)  # redrawn meanwhile, with newer lines: the choice holds
        counts = pane.evaluate(_PANE_LINES)
        assert counts["drawn0"] > 0 and counts["shown0"] == 0 and counts["shown1"] > 0, counts
        assert outcome.inner_text() == "running"
        assert pane.locator(".notebook-accel-stderr").count() > 0
        screenshot(page, "output-per-rank-live", locator=section)
    finally:
        (lab_server.root_dir / stop_file).touch()

    outputs(page).locator(".notebook-accel-outcome").filter(has_text="finished").wait_for(
        timeout=60_000
    )
    # The cell is done: the kernel takes the choice and draws rank 1's lines alone.
    wait_until(
        lambda: pane.evaluate(_PANE_LINES)["drawn0"] == 0 and "[rank" not in pane.inner_text(),
        20,
        "the kernel did not redraw rank 1's lines",
    )
    lines = pane.inner_text().strip().splitlines()
    assert lines and all(line.startswith("rank 1 ") for line in lines)
    stderr = pane.locator(".notebook-accel-stderr")
    assert stderr.count() > 0 and all("warning" in text for text in stderr.all_inner_texts())
