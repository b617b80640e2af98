"""The one reducer: a run's events in, its report out."""

from __future__ import annotations

import pytest

from notebook_accel.reporting.events import (
    AttemptStarted,
    MetricRecord,
    OutputLine,
    PeakResources,
    Progress,
    ResourceSample,
    Restarting,
    Result,
    RunEnded,
    WorkerExited,
    WorkerRaised,
)
from notebook_accel.reporting.report import (
    MAX_CURVE_POINTS,
    MAX_LINE_CHARS,
    MAX_LOG_LINES,
    MAX_RANK_LINES,
    RunReport,
)


def folded(events, **fields) -> RunReport:
    report = RunReport(started_at=1000.0, **fields)
    for event in events:
        report.apply(event)
    return report


def record(step, rank=0, **values) -> MetricRecord:
    return MetricRecord(step=step, rank=rank, values=values, time=1000.0 + (step or 0))


def test_a_finished_run():
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            OutputLine(rank=0, stream="stdout", line="hello\n"),
            OutputLine(rank=1, stream="stderr", line="from one\n"),
            Progress(rank=0, step=1, total=2, elapsed=0.5),
            Progress(rank=1, step=2, total=2, elapsed=0.6),  # not the main rank's bar
            record(0, loss=1.0, phase="train"),
            record(1, loss=0.5),
            record(1, rank=1, loss=0.7),
            Result(rank=0, value="done"),
            WorkerExited(rank=0, exitcode=0),
            WorkerExited(rank=1, exitcode=0),
            RunEnded(error=None, time=1004.5),
        ]
    )
    assert report.status == "finished" and report.error is None
    assert report.duration == 4.5
    assert report.statuses == {0: "finished", 1: "finished"}
    assert report.results == {0: "done"}
    assert list(report.logs) == ["hello\n", "[rank 1] from one\n"]
    assert report.progress == {"step": 1, "total": 2, "elapsed": 0.5}
    assert report.history("loss") == [(0, 1.0), (1, 0.5), (1, 0.7)]
    assert report.history("loss", rank=1) == [(1, 0.7)]
    assert report.latest == {"loss": 0.7, "phase": "train"}
    assert report.curves == {"loss": [(0.0, 1.0), (1.0, 0.5)]}  # the main rank's numbers
    assert report.curve_name() == "loss" and report.has_live_data


def test_memory_samples_and_the_workers_own_peaks_merge_into_one_peak():
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            ResourceSample(rank=0, rss_bytes=100),
            ResourceSample(rank=0, rss_bytes=300),
            ResourceSample(rank=0, rss_bytes=200),
            PeakResources(rank=0, peak_rss_bytes=250, peak_gpu_bytes=64),
            ResourceSample(rank=1, rss_bytes=100),
            PeakResources(rank=1, peak_rss_bytes=500),
        ]
    )
    # A sample higher than the worker's own figure (taken before the sample) still counts.
    assert report.resources[0] == {"rss_bytes": 200, "peak_rss_bytes": 300, "peak_gpu_bytes": 64}
    assert report.resources[1] == {"rss_bytes": 100, "peak_rss_bytes": 500}


def test_a_restart_counts_clears_the_failed_attempts_results_and_is_logged():
    failure = RuntimeError("worker rank 1 exited with code 9\nmore lines")
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            Result(rank=0, value="from the failed attempt"),
            WorkerRaised(rank=1, exception="ValueError: x", traceback="", time=1.0),
            WorkerExited(rank=1, exitcode=1),
            Restarting(attempt=1, error=failure),
        ]
    )
    assert report.restarts == 1 and report.statuses[1] == "failed"
    report.apply(AttemptStarted(workers=2, attempt=1))
    assert report.results == {} and report.statuses == {0: "running", 1: "running"}
    assert report.status == "running"
    assert list(report.logs) == [
        "restarting after: worker rank 1 exited with code 9\n",
        "--- restart 1 ---\n",
    ]
    report.apply(Result(rank=0, value="second"))
    report.apply(RunEnded(error=None, time=1002.0))
    assert report.results == {0: "second"} and report.restarts == 1


@pytest.mark.parametrize(
    ("error", "status", "left_running"),
    [
        (KeyboardInterrupt("the run was stopped"), "stopped", "stopped"),
        (TimeoutError("late"), "timed out", "stopped"),
        (RuntimeError("worker rank 1 raised"), "failed", "stopped"),
        (None, "finished", "finished"),
    ],
)
def test_the_outcome_follows_the_error_and_running_ranks_end_with_it(error, status, left_running):
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            WorkerExited(rank=1, exitcode=-9),
            RunEnded(error=error, time=1001.0),
        ]
    )
    assert report.status == status and report.error is error
    assert report.statuses == {0: left_running, 1: "failed"}


def test_the_report_of_a_second_machine_knows_its_own_ranks():
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            OutputLine(rank=2, stream="stdout", line="main here\n"),
            OutputLine(rank=3, stream="stdout", line="other\n"),
            Progress(rank=2, step=3, total=None, elapsed=1.0),
        ],
        main_rank=2,
    )
    assert sorted(report.statuses) == [2, 3]
    assert list(report.logs) == ["main here\n", "[rank 3] other\n"]
    assert report.progress["step"] == 3


def test_the_view_only_parts_stay_bounded():
    report = RunReport()
    report.apply(AttemptStarted(workers=1, attempt=0))
    for step in range(MAX_CURVE_POINTS + 1):
        report.apply(record(step, loss=float(step)))
    for index in range(MAX_LOG_LINES + 10):
        report.apply(OutputLine(rank=0, stream="stdout", line=f"{index}\n"))
    assert len(report.metrics) == MAX_CURVE_POINTS + 1  # the history itself is whole
    assert len(report.curves["loss"]) <= MAX_CURVE_POINTS
    assert report.curves["loss"][-1] == (float(MAX_CURVE_POINTS), float(MAX_CURVE_POINTS))
    assert len(report.logs) == MAX_LOG_LINES and report.logs[-1] == f"{MAX_LOG_LINES + 9}\n"


def test_a_metric_without_a_step_is_drawn_at_its_place_in_the_history():
    report = folded([record(None, loss=2.0), record(None, loss=1.0)])
    assert report.curves["loss"] == [(1.0, 2.0), (2.0, 1.0)]


# -- the output per rank ---------------------------------------------------------------


def line(rank, text, stream="stdout") -> OutputLine:
    return OutputLine(rank=rank, stream=stream, line=text + "\n")


def texts(lines) -> list[tuple[int | None, str]]:
    return [(kept.rank, kept.text) for kept in lines]


def test_each_rank_s_output_is_kept_apart_in_order_and_knows_stderr():
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            line(0, "a0"),
            line(1, "b0", "stderr"),
            line(0, "a1"),
            line(1, "b1"),
        ]
    )
    assert texts(report.output(0)) == [(0, "a0"), (0, "a1")]
    assert texts(report.output(1)) == [(1, "b0"), (1, "b1")]
    assert texts(report.output()) == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1")]
    assert [kept.stderr for kept in report.output()] == [False, True, False, False]
    assert [kept.index for kept in report.output()] == [0, 1, 2, 3]
    assert texts(report.output(1, last=1)) == [(1, "b1")]
    assert texts(report.output(last=3)) == [(1, "b0"), (0, "a1"), (1, "b1")]
    assert report.output(last=0) == [] and report.output(5) == []
    assert report.output_ranks() == [0, 1] and report.lines_received == 4
    # The mixed log is as it was.
    assert list(report.logs) == ["a0\n", "[rank 1] b0\n", "a1\n", "[rank 1] b1\n"]


def test_restart_separators_show_in_every_rank_s_output():
    report = folded(
        [
            AttemptStarted(workers=2, attempt=0),
            line(0, "first try"),
            line(1, "boom", "stderr"),
            Restarting(attempt=1, error=RuntimeError("worker rank 1 exited")),
            AttemptStarted(workers=2, attempt=1),
            line(1, "second try"),
        ]
    )
    separators = [(None, "restarting after: worker rank 1 exited"), (None, "--- restart 1 ---")]
    assert texts(report.output(0)) == [(0, "first try"), *separators]
    assert texts(report.output(1)) == [(1, "boom"), *separators, (1, "second try")]
    assert texts(report.output())[1:4] == [(1, "boom"), *separators]


def test_each_rank_keeps_its_own_newest_lines():
    report = folded([AttemptStarted(workers=2, attempt=0), line(1, "quiet rank")])
    for index in range(MAX_RANK_LINES + 50):
        report.apply(line(0, f"chatty {index}"))
    chatty = report.output(0)
    assert len(chatty) == MAX_RANK_LINES
    assert chatty[0].text == "chatty 50" and chatty[-1].text == f"chatty {MAX_RANK_LINES + 49}"
    assert texts(report.output(1)) == [(1, "quiet rank")]  # not pushed out by rank 0
    everything = report.output()
    assert len(everything) == MAX_RANK_LINES + 1 and everything[0].text == "quiet rank"
    assert report.lines_received == MAX_RANK_LINES + 51


def test_a_line_keeps_what_a_terminal_shows_and_its_first_characters():
    report = folded(
        [
            line(0, " 10%|#   |\r 50%|#####   |\r100%|########|\r"),
            line(0, "x" * (MAX_LINE_CHARS + 7)),
        ]
    )
    redrawn, long = report.output(0)
    assert redrawn.text == "100%|########|"
    assert long.text == "x" * MAX_LINE_CHARS + " ... [7 more characters]"
