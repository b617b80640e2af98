"""The workers' output per rank: a rank filter over a scrollable pane of their lines.

The pane shows the newest MAX_SHOWN_LINES lines of the chosen rank (or of every
rank, each line prefixed with its rank), stderr and error lines marked. The kernel
draws the chosen rank's lines; while a cell keeps the kernel busy, the kernel only
hears of a new choice once the cell is done, so CSS in the pane also hides the other
ranks' lines at once, in the browser.
"""

from __future__ import annotations

import re
import threading
import time
from html import escape

import ipywidgets as widgets

from notebook_accel.reporting.report import FINAL_STATUSES, LogLine, RunReport

# The filter's value for every rank's lines (a dropdown's None means nothing chosen).
ALL = "all"

# The pane draws at most this many of the newest lines: enough to read back, cheap to send.
MAX_SHOWN_LINES = 500

# A traceback's first line, a fatal error, "SomeError: ..." or "SomeException".
_ERROR_LINE = re.compile(
    r"^(Traceback \(most recent call last\)|Fatal Python error|[\w.]*(Error|Exception)\b(:|$))"
)

# Fixed colours (not the theme's): stderr stays readable on light and dark themes.
_STYLE = """
.notebook-accel-output pre.notebook-accel-logs {
  margin: 0; white-space: pre-wrap; word-break: break-word; font-size: 12px; line-height: 1.35;
}
.notebook-accel-output .notebook-accel-stderr { background: #fdd; color: #900; }
.notebook-accel-output .notebook-accel-error { color: #c00; font-weight: bold; }
.notebook-accel-output .notebook-accel-notice { color: #888; font-style: italic; }
"""


def is_error_line(text: str) -> bool:
    """Whether a line looks like the start or the end of a traceback, or a fatal error."""
    return _ERROR_LINE.match(text) is not None


def rank_label(rank: int) -> str:
    """How the filter and the "all" view name a rank: "rank 1"."""
    return f"rank {rank}"


def shown_ranks(report: RunReport) -> list[int]:
    """The ranks the filter offers: this machine's workers, and any that wrote output."""
    return sorted(set(report.statuses) | set(report.output_ranks()))


def lines_html(lines: list[LogLine], prefixed: bool) -> str:
    """The lines as a <pre>, one <span> each with its rank; `prefixed` writes the rank."""
    spans = []
    for line in lines:
        classes = "notebook-accel-line"
        if line.rank is None:
            classes += " notebook-accel-notice"
        if line.stderr:
            classes += " notebook-accel-stderr"
        if is_error_line(line.text):
            classes += " notebook-accel-error"
        rank = "" if line.rank is None else f' data-rank="{line.rank}"'
        prefix = f"[{rank_label(line.rank)}] " if prefixed and line.rank is not None else ""
        spans.append(f'<span class="{classes}"{rank}>{escape(prefix + line.text)}\n</span>')
    return f'<pre class="notebook-accel-logs">{"".join(spans)}</pre>'


def filter_css(ranks: list[int]) -> str:
    """Rules that hide the other ranks' lines as soon as a rank is picked in the browser
    (whatever the kernel drew), for a kernel that is busy running the cell."""
    rules = [
        f'.notebook-accel-output:has(.notebook-accel-rank-filter option:checked[value="'
        f'{rank_label(rank)}"]) .notebook-accel-line[data-rank]:not([data-rank="{rank}"])'
        " { display: none; }"
        for rank in ranks
    ]
    return _STYLE + "\n".join(rules)


class RankOutput:
    """A rank filter ("all", "rank 0", ...) over a pane of the workers' output lines.

    `refresh(report)` redraws it: output that has not changed is not drawn again,
    and a redraw less than `interval` seconds after the last one is skipped (the
    next refresh draws it), unless `force` or the run is over.
    """

    # A little under RunView.interval, so that a view's periodic redraws all draw
    # and only the extra ones (several workers exiting at once) are skipped.
    interval = 0.2

    def __init__(
        self, max_lines: int = MAX_SHOWN_LINES, height: str = "260px", since: int = 0
    ) -> None:
        self.max_lines = max_lines
        self.since = since  # the first line shown (RunReport.output)
        self.filter = widgets.Dropdown(
            options=[("all", ALL)],
            value=ALL,
            description="Show",
            layout=widgets.Layout(width="200px"),
        )
        self.filter.add_class("notebook-accel-rank-filter")
        self.summary = widgets.HTML()
        self.summary.add_class("notebook-accel-output-summary")
        # Laid out bottom up, so that the pane stays scrolled to the newest line.
        self.pane = widgets.HTML(
            layout=widgets.Layout(
                max_height=height,
                overflow="auto",
                display="flex",
                flex_flow="column-reverse",
                border="1px solid #ddd",
                padding="2px 4px",
            )
        )
        self.pane.add_class("notebook-accel-output-pane")
        self.box = widgets.VBox([widgets.HBox([self.filter, self.summary]), self.pane])
        self.box.add_class("notebook-accel-output")
        self.report: RunReport | None = None
        self._ranks: list[int] = []
        self._drawn_report: RunReport | None = None
        self._drawn: tuple | None = None  # what the pane shows: (lines received, rank, ranks)
        self._drawn_at = 0.0
        # The run's thread refreshes, the kernel's thread answers the filter.
        self._lock = threading.RLock()
        self._offering = False
        self.filter.observe(self._on_filter, names="value")

    @property
    def rank(self) -> int | None:
        """The rank whose lines are shown; None: every rank's."""
        value = self.filter.value
        return None if value == ALL else value

    def refresh(self, report: RunReport, force: bool = False) -> bool:
        """Draw `report`'s output as it is now; return whether the pane was drawn."""
        with self._lock:
            self.report = report
            ranks = shown_ranks(report)
            if ranks != self._ranks:
                self._offer(ranks)
            state = (report.lines_received, self.rank, tuple(ranks))
            if report is self._drawn_report and state == self._drawn:
                return False
            now = time.monotonic()
            if (
                not force
                and report.status not in FINAL_STATUSES
                and now - self._drawn_at < self.interval
            ):
                return False
            self._draw(report, ranks)
            self._drawn_report, self._drawn, self._drawn_at = report, state, now
            return True

    def _draw(self, report: RunReport, ranks: list[int]) -> None:
        rank = self.rank
        lines = report.output(rank, last=self.max_lines, since=self.since)
        self.pane.value = f"<style>{filter_css(ranks)}</style>" + lines_html(
            lines, prefixed=rank is None
        )
        # Said only when lines are left out (a count would be wrong while the browser
        # filters lines the kernel drew).
        truncated = len(lines) >= self.max_lines
        self.summary.value = f"<small>the newest {len(lines)} lines</small>" if truncated else ""

    def _offer(self, ranks: list[int]) -> None:
        """Offer these ranks in the filter, keeping the one chosen when it is still there."""
        chosen = self.rank
        self._offering = True
        try:
            self.filter.options = [("all", ALL)] + [(rank_label(r), r) for r in ranks]
            self.filter.value = chosen if chosen in ranks else ALL
        finally:
            self._offering = False
        self._ranks = ranks

    def _on_filter(self, change: dict) -> None:
        if self._offering or self.report is None:
            return
        self.refresh(self.report, force=True)
