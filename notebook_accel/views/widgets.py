"""ipywidgets that draw a run's report: progress, metrics, loss curve, ranks, logs."""

from __future__ import annotations

from html import escape

import ipywidgets as widgets

from notebook_accel.reporting.report import FINAL_STATUSES, RunReport
from notebook_accel.views import format as fmt
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
    """The widgets of one run's display; `refresh(report)` redraws them."""

    def __init__(self, show_logs: bool = False) -> None:
        self.bar = widgets.IntProgress(
            value=0, min=0, max=1, description="", layout=widgets.Layout(width="320px")
        )
        self.bar_label = widgets.Label(value="waiting for the first step")
        self.ranks = widgets.HTML()
        self.metrics = widgets.HTML()
        self.chart = widgets.HTML()
        self.logs = widgets.HTML(layout=widgets.Layout(max_height="220px", overflow="auto"))
        parts = [
            widgets.HBox([self.bar, self.bar_label]),
            self.ranks,
            widgets.HBox([self.chart, self.metrics]),
        ]
        if show_logs:
            parts.append(self.logs)
        self.box = widgets.VBox(parts)
        self.box.add_class("notebook-accel-run")

    def refresh(self, report: RunReport) -> None:
        """Draw `report` as it is now."""
        progress = report.progress
        if progress:
            total = progress.get("total") or max(progress["step"], 1)
            self.bar.max = total
            self.bar.value = min(progress["step"], total)
            self.bar_label.value = fmt.progress_line(
                progress["step"], progress.get("total"), progress["elapsed"]
            )
        if report.status in FINAL_STATUSES:
            self.bar.bar_style = "success" if report.status == "finished" else "danger"
        self.ranks.value = ranks_html(report)
        self.metrics.value = metrics_html(report)
        name = report.curve_name()
        if name is not None:
            self.chart.value = line_chart(report.curves[name], title=name)
        self.logs.value = (
            "<pre class='notebook-accel-logs' style='margin:0'>"
            + escape("".join(report.logs))
            + "</pre>"
        )


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
