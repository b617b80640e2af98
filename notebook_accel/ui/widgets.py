"""ipywidgets that draw a RunState: progress, metrics, loss curve, ranks, logs."""

from __future__ import annotations

from html import escape

import ipywidgets as widgets

from notebook_accel.ui import format as fmt
from notebook_accel.ui.plot import line_chart
from notebook_accel.ui.state import RunState

STATUS_COLOURS = {
    "starting": "#888",
    "running": "#1f77b4",
    "finished": "#2ca02c",
    "failed": "#d62728",
    "stopped": "#ff7f0e",
}


class RunWidgets:
    """The widgets of one run's display; `refresh(state)` redraws them."""

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

    def refresh(self, state: RunState) -> None:
        progress = state.progress
        if progress:
            total = progress.get("total") or max(progress["step"], 1)
            self.bar.max = total
            self.bar.value = min(progress["step"], total)
            self.bar_label.value = fmt.progress_line(
                progress["step"], progress.get("total"), progress["elapsed"]
            )
        if state.outcome in ("finished", "failed", "stopped", "timed out"):
            self.bar.bar_style = "success" if state.outcome == "finished" else "danger"
        self.ranks.value = ranks_html(state)
        self.metrics.value = metrics_html(state)
        name = state.curve_name()
        if name is not None:
            self.chart.value = line_chart(state.curves[name], title=name)
        self.logs.value = (
            "<pre class='notebook-accel-logs' style='margin:0'>"
            + escape("".join(state.logs))
            + "</pre>"
        )


def ranks_html(state: RunState) -> str:
    chips = []
    for rank, status in sorted(state.statuses.items()):
        colour = STATUS_COLOURS.get(status, "#888")
        figures = state.resources.get(rank, {})
        memory = figures.get("peak_rss_bytes") or figures.get("rss_bytes")
        extra = f" · {fmt.size(memory)}" if memory else ""
        if figures.get("peak_gpu_bytes"):
            extra += f" · GPU {fmt.size(figures['peak_gpu_bytes'])}"
        chips.append(
            f"<span class='notebook-accel-rank' data-status='{status}' style='display:inline-block;"
            f"margin:2px 6px 2px 0;padding:1px 6px;border-radius:8px;color:white;"
            f"background:{colour}'>rank {rank}: {status}{escape(extra)}</span>"
        )
    outcome = (
        f"<b class='notebook-accel-outcome'>{escape(state.outcome)}</b> " if state.outcome else ""
    )
    return f"<div>{outcome}{''.join(chips)}</div>"


def metrics_html(state: RunState) -> str:
    if not state.latest:
        return ""
    rows = "".join(
        f"<tr><td style='padding-right:8px'>{escape(name)}</td>"
        f"<td><code>{escape(fmt.number(value))}</code></td></tr>"
        for name, value in state.latest.items()
    )
    return f"<table class='notebook-accel-metrics'>{rows}</table>"
