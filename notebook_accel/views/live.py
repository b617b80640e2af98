"""The live display of a launch: widgets in a notebook, text lines in a script."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from notebook_accel.reporting.report import RunReport
from notebook_accel.views import format as fmt
from notebook_accel.views.state import RunView


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, Notebook, VS Code, Colab)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def live_view(
    plan: Any = None, force: bool = False, since: int = 0, output: str = "collapsed"
) -> RunView | None:
    """The right live display for where the launch runs.

    `force` shows the widgets from the start, not only once progress or a
    metric arrives. `since`: the first of the report's output lines to show (a live
    group's call shows its own). `output`: how the widgets show the output per rank
    (views/widgets.py). `plan` is accepted for callers that pass it; a view
    reads everything from the run's report.
    """
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return TextView()
        return WidgetView(show_always=force, since=since, output=output)
    return TextView()


class WidgetView(RunView):
    """Shows progress, metrics and the loss curve under the running cell, and with
    several ranks their output per rank, in a section that starts closed (the cell
    prints every line already; the section is there to pick one rank's).

    It appears with the first progress update or metric, so a launch that
    reports neither leaves the cell as it was. `output="open"` shows the output
    per rank open instead (a detached run's cell prints nothing itself).
    """

    def __init__(self, show_always: bool = False, since: int = 0, output: str = "collapsed"):
        super().__init__()
        self.show_always = show_always
        self.since = since
        self.output = output
        self.widgets = None

    def show(self) -> None:
        """Display the widgets under the running cell now (a view that another thread
        will draw: what it displays later would land in whichever cell runs then)."""
        if self.widgets is None:
            from IPython.display import display

            from notebook_accel.views.widgets import RunWidgets

            self.widgets = RunWidgets(output=self.output, since=self.since)
            display(self.widgets.box)

    def changed(self, final: bool) -> None:
        report = self.report
        if self.widgets is None:
            if not (report.has_live_data or self.show_always):
                return
            self.show()
        self.widgets.refresh(report, force=final or not self.periodic)


class TextView(RunView):
    """Prints a progress line every few seconds, and a summary at the end."""

    interval = 2.0

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self.stream = stream
        self._last_line = ""

    def changed(self, final: bool) -> None:
        report = self.report
        if not report.has_live_data:
            return
        out = self.stream or sys.stdout
        if final:
            memory = ", ".join(
                f"rank {rank} {fmt.size(figures.get('peak_rss_bytes'))}"
                for rank, figures in sorted(report.resources.items())
            )
            out.write(
                f"[notebook_accel] {report.status} in {fmt.duration(report.duration)}"
                + (f" · peak memory: {memory}" if memory else "")
                + "\n"
            )
        else:
            line = status_line(report)
            if line == self._last_line:
                return
            self._last_line = line
            out.write(f"[notebook_accel] {line}\n")
        out.flush()


def status_line(report: RunReport) -> str:
    """One line of a report's progress and latest metric values."""
    parts = []
    if report.progress:
        progress = report.progress
        parts.append(
            fmt.progress_line(progress["step"], progress.get("total"), progress["elapsed"])
        )
    parts += [f"{name} {fmt.number(value)}" for name, value in report.latest.items()]
    return " · ".join(parts)
