"""The browser harness itself, on a plain ipywidgets notebook: JupyterLab runs it in
Chromium, a click on a Button reaches the kernel, and the Label it changes redraws."""

from __future__ import annotations

import time

import pytest

from browser_harness import (
    button,
    choose,
    click,
    label,
    run_notebook_in_lab,
    screenshot,
    wait_for_text,
    widget,
    widget_text,
    write_notebook,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

CELLS = [
    """
import ipywidgets as widgets

clicks = widgets.Label("clicked 0 times")
processes = widgets.BoundedIntText(value=1, min=1, max=8, description="Processes")
precision = widgets.Dropdown(options=["no", "fp16", "bf16"], description="Precision")
verbose = widgets.Checkbox(description="Verbose")
go = widgets.Button(description="Go")

def on_click(_):
    count = int(clicks.value.split()[1]) + 1
    chosen = (processes.value, precision.value, verbose.value)
    clicks.value = f"clicked {count} times with {chosen}"

go.on_click(on_click)
widgets.VBox([processes, precision, verbose, go, clicks])
""",
    'print("ready")',
]


def test_click_a_button_and_see_the_label_change(lab_server, page):
    started = time.monotonic()
    write_notebook(lab_server, "widgets.ipynb", CELLS)

    run_notebook_in_lab(page, lab_server, "widgets.ipynb")
    ran = time.monotonic()
    wait_for_text(page, "ready")
    assert widget_text(label(page, "clicked")) == "clicked 0 times"
    assert widget(page, "Precision").count() == 1

    click(page, "Go")
    wait_for_text(page, "clicked 1 times with (1, 'no', False)")
    choose(page, "Processes", 2)
    choose(page, "Precision", "bf16")
    choose(page, "Verbose", True)
    click(page, "Go")
    wait_for_text(page, "clicked 2 times with (2, 'bf16', True)")
    assert button(page, "Go").is_enabled()

    shot = screenshot(page, "browser-harness-widgets")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000, "a blank page would be a few hundred bytes"

    finished = time.monotonic()
    print(
        f"server start {lab_server.startup_seconds:.1f} s, open and run {ran - started:.1f} s,"
        f" clicks and screenshot {finished - ran:.1f} s"
    )
    assert finished - started < 60
