"""ipywidgets that draw a run's report: progress, metrics, loss curve, ranks, output."""

from __future__ import annotations

from html import escape

import ipywidgets as widgets

from notebook_accel.reporting.report import FINAL_STATUSES, RunReport
from notebook_accel.views import format as fmt
from notebook_accel.views.output import RankOutput, shown_ranks
from notebook_accel.views.plot import line_chart

STATUS_COLOURS = {
    "starting": "#888",
    "running": "#1f77b4",
    "finished": "#2ca02c",
    "failed": "#d62728",
    "stopped": "#ff7f0e",
    "timed out": "#d62728",
}


class RunWidgets:
    """The widgets of one run's display; `refresh(report)` redraws them.

    `output` places the workers' output per rank (views/output.py): "open" (the
    panel), "collapsed" (under a launched cell, whose printed text already shows
    every line: a closed section, added once the run has more than one rank), or
    "none". `since`: the first of the report's output lines to show (a live group's
    report holds every call's; a call's view shows its own).
    """

    def __init__(self, output: str = "none", since: int = 0) -> None:
        self.bar = widgets.IntProgress(
            value=0, min=0, max=1, description="", layout=widgets.Layout(width="320px")
        )
        self.bar_label = widgets.Label(value="waiting for the first step")
        self.bar_label.add_class("notebook-accel-progress")
        self.ranks = widgets.HTML()
        self.metrics = widgets.HTML()
        self.chart = widgets.HTML()
        self.output_mode = output
        self.output = RankOutput(since=since)
        self.logs = self.output.pane  # the pane of output lines, under its former name
        self.output_section: widgets.Accordion | None = None
        parts = [
            widgets.HBox([self.bar, self.bar_label]),
            self.ranks,
            widgets.HBox([self.chart, self.metrics]),
        ]
        if output == "open":
            parts.append(self.output.box)
        self.box = widgets.VBox(parts)
        self.box.add_class("notebook-accel-run")

    def refresh(self, report: RunReport, force: bool = False) -> None:
        """Draw `report` as it is now; the output pane may skip a redraw that comes
        soon after the last one, unless `force` (views/output.py)."""
        # The output first: whoever waits for the outcome then finds every line drawn.
        self._refresh_output(report, force)
        self._refresh_progress(report)
        self.ranks.value = ranks_html(report)
        self.metrics.value = metrics_html(report)
        name = report.curve_name()
        if name is not None:
            self.chart.value = line_chart(report.curves[name], title=name)

    def _refresh_progress(self, report: RunReport) -> None:
        progress = report.progress
        if progress:
            total = progress.get("total") or max(progress["step"], 1)
            self.bar.max = total
            self.bar.value = min(progress["step"], total)
        elif report.status == "finished":
            self.bar.max, self.bar.value = 1, 1  # steps without a progress bar: all done
        else:
            self.bar.max, self.bar.value = 1, 0
        if report.status in FINAL_STATUSES:
            self.bar.bar_style = "success" if report.status == "finished" else "danger"
        else:
            self.bar.bar_style = ""  # a new run in a panel that showed an ended one
        self.bar_label.value = progress_text(report)

    def _refresh_output(self, report: RunReport, force: bool) -> None:
        if self.output_mode == "collapsed" and self.output_section is None:
            if len(shown_ranks(report)) < 2:
                return  # one rank: the cell's printed text is all there is
            self.output_section = widgets.Accordion(children=[self.output.box])
            self.output_section.set_title(0, "Output per rank")
            self.output_section.add_class("notebook-accel-output-section")
            self.box.children = (*self.box.children, self.output_section)
        if self.output_mode != "none":
            self.output.refresh(report, force=force)


def progress_text(report: RunReport) -> str:
    """The line beside the progress bar: the run's step while it runs (its progress
    bar's, else its newest logged one), then how it ended and at which step."""
    step = report.last_step()
    progress = report.progress
    if report.status not in FINAL_STATUSES:
        if progress:
            return fmt.progress_line(progress["step"], progress.get("total"), progress["elapsed"])
        if step is not None:
            return f"step {step}"
        return "starting" if report.status == "starting" else "waiting for the first step"
    if step is None:
        where = "" if report.status == "finished" else " before the first step"
    else:
        total = progress.get("total") if progress else None
        where = f" at step {step}/{total}" if total else f" at step {step}"
    return f"{report.status}{where} · {fmt.duration(report.duration)}"


def ranks_html(report: RunReport) -> str:
    """One chip per rank on this machine (status and memory), after the run's status."""
    chips = []
    for rank, status in sorted(report.statuses.items()):
        colour = STATUS_COLOURS.get(status, "#888")
        figures = report.resources.get(rank, {})
        # While a worker runs, its memory now; after, the most it used.
        first, then = "rss_bytes", "peak_rss_bytes"
        if status != "running":
            first, then = then, first
        memory = figures.get(first) or figures.get(then)
        extra = f" · {fmt.size(memory)}" if memory else ""
        if figures.get("peak_gpu_bytes"):
            extra += f" · GPU {fmt.size(figures['peak_gpu_bytes'])}"
        chips.append(
            f"<span class='notebook-accel-rank' data-status='{status}' style='display:inline-block;"
            f"margin:2px 6px 2px 0;padding:1px 6px;border-radius:8px;color:white;"
            f"background:{colour}'>rank {rank}: {status}{escape(extra)}</span>"
        )
    outcome = f"<b class='notebook-accel-outcome'>{escape(report.status)}</b> "
    return f"<div>{outcome}{''.join(chips)}</div>"


def metrics_html(report: RunReport) -> str:
    """The latest value of every metric, as a table."""
    if not report.latest:
        return ""
    rows = "".join(
        f"<tr><td style='padding-right:8px'>{escape(name)}</td>"
        f"<td><code>{escape(fmt.number(value))}</code></td></tr>"
        for name, value in report.latest.items()
    )
    return f"<table class='notebook-accel-metrics'>{rows}</table>"
