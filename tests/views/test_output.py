"""The output per rank: the rank filter, the pane's lines and marks, bounds and throttling,
in the panel's display and under a launched cell (no browser: the widgets' values)."""

from __future__ import annotations

import re

import pytest

from notebook_accel.reporting.events import (
    AttemptStarted,
    OutputLine,
    Progress,
    RunEnded,
    WorkerExited,
)
from notebook_accel.reporting.report import RunReport
from notebook_accel.views.live import WidgetView
from notebook_accel.views.output import RankOutput, filter_css, is_error_line
from notebook_accel.views.widgets import RunWidgets

pytestmark = pytest.mark.timeout(30)


def report_of(workers: int, lines: list[tuple[int, str, str]], main_rank: int = 0) -> RunReport:
    report = RunReport(main_rank=main_rank)
    report.apply(AttemptStarted(workers=workers, attempt=0))
    for rank, stream, text in lines:
        report.apply(OutputLine(rank=rank, stream=stream, line=text + "\n"))
    return report


def shown(output: RankOutput) -> list[str]:
    """The pane's lines as a browser shows them (tags and the style block left out)."""
    body = output.pane.value.split("</style>", 1)[-1]
    return [text for text in re.sub(r"<[^>]+>", "", body).split("\n") if text]


TWO_RANKS = [
    (0, "stdout", "rank 0 says 1"),
    (1, "stdout", "rank 1 says 1"),
    (1, "stderr", "rank 1 warns <careful>"),
    (0, "stdout", "rank 0 says 2"),
]


def test_all_ranks_interleaved_and_prefixed_then_one_rank_alone():
    output = RankOutput()
    report = report_of(2, TWO_RANKS)
    assert output.refresh(report)
    assert [label for label, _ in output.filter.options] == ["all", "rank 0", "rank 1"]
    assert output.rank is None
    assert shown(output) == [
        "[rank 0] rank 0 says 1",
        "[rank 1] rank 1 says 1",
        "[rank 1] rank 1 warns &lt;careful&gt;",  # escaped
        "[rank 0] rank 0 says 2",
    ]
    output.filter.value = 1  # what picking "rank 1" does: drawn at once
    assert output.rank == 1
    assert shown(output) == ["rank 1 says 1", "rank 1 warns &lt;careful&gt;"]
    assert "rank 0 says" not in output.pane.value


def test_stderr_and_error_lines_are_marked():
    report = report_of(
        2,
        [
            (0, "stdout", "fine"),
            (1, "stderr", "a warning"),
            (1, "stderr", "Traceback (most recent call last):"),
            (0, "stdout", "ValueError: printed to stdout"),
        ],
    )
    output = RankOutput()
    output.refresh(report)
    pane = output.pane.value
    assert 'class="notebook-accel-line" data-rank="0">[rank 0] fine' in pane
    assert 'class="notebook-accel-line notebook-accel-stderr" data-rank="1">' in pane
    assert 'notebook-accel-stderr notebook-accel-error" data-rank="1">[rank 1] Traceback' in pane
    assert 'class="notebook-accel-line notebook-accel-error" data-rank="0">' in pane
    assert ".notebook-accel-stderr { background: #fdd; color: #900; }" in pane
    assert is_error_line("torch.distributed.DistBackendError: NCCL error")
    assert is_error_line("KeyboardInterruptException")
    assert not is_error_line("Error rate 0.1") and not is_error_line("loss: 0.5")


def test_picking_a_rank_in_the_browser_hides_the_others_lines_by_css():
    # While a cell keeps the kernel busy, the browser filters on its own.
    css = filter_css([0, 1])
    assert (
        '.notebook-accel-output:has(.notebook-accel-rank-filter option:checked[value="rank 1"])'
        ' .notebook-accel-line[data-rank]:not([data-rank="1"]) { display: none; }'
    ) in css


def test_the_pane_draws_only_the_newest_lines():
    output = RankOutput(max_lines=50)
    report = report_of(2, [(rank, "stdout", f"{rank}:{i}") for i in range(100) for rank in (0, 1)])
    output.refresh(report)
    lines = shown(output)
    assert len(lines) == 50 and lines[-1] == "[rank 1] 1:99" and lines[0] == "[rank 0] 0:75"
    assert "newest 50 lines" in output.summary.value
    output.filter.value = 0
    assert shown(output)[0] == "0:50" and len(shown(output)) == 50


def test_redraws_are_throttled_but_forced_and_final_ones_draw():
    output = RankOutput()
    output.interval = 60.0  # every redraw after the first falls inside the interval
    report = report_of(2, TWO_RANKS)
    assert output.refresh(report)
    assert not output.refresh(report)  # nothing new
    report.apply(OutputLine(rank=0, stream="stdout", line="late line\n"))
    assert not output.refresh(report)  # new, but too soon
    assert "late line" not in output.pane.value
    assert output.refresh(report, force=True) and "late line" in output.pane.value
    report.apply(OutputLine(rank=1, stream="stdout", line="last words\n"))
    report.apply(RunEnded(error=None))
    assert output.refresh(report)  # the run is over: always drawn
    assert "last words" in output.pane.value
    output.filter.value = 1  # a new choice draws at once
    assert shown(output)[-1] == "last words"


def test_a_rank_chosen_stays_chosen_when_more_ranks_write():
    output = RankOutput()
    report = RunReport(main_rank=4)  # a second machine's ranks: 4 and up
    report.apply(OutputLine(rank=4, stream="stdout", line="four\n"))
    output.refresh(report)
    output.filter.value = 4
    report.apply(OutputLine(rank=5, stream="stdout", line="five\n"))
    output.refresh(report, force=True)
    assert [label for label, _ in output.filter.options] == ["all", "rank 4", "rank 5"]
    assert output.rank == 4 and shown(output) == ["four"]


def test_the_panel_s_display_shows_the_output_and_keeps_logs_readable():
    widgets = RunWidgets(output="open")
    assert widgets.output.box in widgets.box.children
    widgets.refresh(report_of(2, TWO_RANKS))
    assert widgets.logs is widgets.output.pane
    assert "[rank 1] rank 1 says 1" in widgets.logs.value
    assert "notebook-accel-output" in widgets.output.box._dom_classes
    assert "notebook-accel-rank-filter" in widgets.output.filter._dom_classes


def run_view(workers: int, monkeypatch) -> tuple[WidgetView, RunReport]:
    """A live view under a cell after a run's first events: progress and a line per rank."""
    view, report = WidgetView(), RunReport()
    view.interval = 0.0  # every event redraws, the pane too
    monkeypatch.setattr(RankOutput, "interval", 0.0)
    events = [AttemptStarted(workers=workers, attempt=0)]
    events += [Progress(rank=0, step=1, total=3, elapsed=0.1)]
    events += [OutputLine(rank=r, stream="stdout", line=f"r{r}\n") for r in range(workers)]
    for event in events:
        report.apply(event)
        view.on_event(event, report)
    return view, report


def test_under_a_cell_the_output_is_a_closed_section_once_there_are_two_ranks(monkeypatch):
    view, _ = run_view(2, monkeypatch)
    section = view.widgets.output_section
    assert section is not None and section in view.widgets.box.children
    assert section.selected_index is None  # closed: the cell prints the lines already
    assert section.get_title(0) == "Output per rank"
    assert "[rank 1] r1" in view.widgets.logs.value

    single, _ = run_view(1, monkeypatch)
    assert single.widgets is not None and single.widgets.output_section is None
    assert single.widgets.output.box not in single.widgets.box.children


def test_a_redraw_asked_outside_the_events_draws_the_newest_lines(monkeypatch):
    # A live group's call ended: it asks every view to draw the call's last figures.
    view, report = run_view(2, monkeypatch)
    view.interval, view.widgets.output.interval = 60.0, 60.0
    for event in (
        OutputLine(rank=1, stream="stdout", line="printed last\n"),  # no redraw yet
        WorkerExited(rank=0, exitcode=0),  # redrawn at once, but the pane may wait
    ):
        report.apply(event)
        view.on_event(event, report)
    assert "printed last" not in view.widgets.logs.value
    view.changed(final=False)
    assert "printed last" in view.widgets.logs.value
