"""A detached run's event log: every event read back in order, records cut short read once
whole, and a bounded size that keeps what a view needs."""

from __future__ import annotations

import os

import pytest

from notebook_accel.launch.errors import WorkerError, WorkerFailure
from notebook_accel.launch.runs import log as run_log
from notebook_accel.launch.runs.log import EventLogReader, EventLogWriter, segments
from notebook_accel.reporting.events import (
    MetricRecord,
    OutputLine,
    Progress,
    Result,
    RunEnded,
)
from notebook_accel.reporting.report import MAX_RANK_LINES, RunReport


def line(rank: int, number: int) -> OutputLine:
    return OutputLine(rank, "stdout", f"rank {rank} line {number}\n")


def test_a_reader_gets_every_event_in_order_then_what_comes_later(tmp_path):
    writer = EventLogWriter(tmp_path)
    reader = EventLogReader(tmp_path)
    assert reader.read_available() == []
    writer.append(line(0, 0))
    writer.append(MetricRecord(1, 0, {"loss": 0.5}, 0.0))
    assert [event for _, event in reader.read_available()] == [
        line(0, 0),
        MetricRecord(1, 0, {"loss": 0.5}, 0.0),
    ]
    assert reader.read_available() == []
    error = WorkerError(
        [WorkerFailure(1, 1, "Traceback ...\nValueError: bad\n", "ValueError: bad")]
    )
    writer.append(RunEnded(error))
    ((_, ended),) = reader.read_available()
    assert isinstance(ended.error, WorkerError)
    assert ended.error.rank == 1 and str(ended.error) == str(error)


def test_a_record_cut_short_is_read_once_it_is_whole(tmp_path):
    writer = EventLogWriter(tmp_path)
    writer.append(line(0, 0))
    record = run_log.encode(2, Result(0, 42))
    path = run_log.segment_path(tmp_path, 0)
    reader = EventLogReader(tmp_path)
    for cut in (1, run_log.HEADER.size + 1, len(record) - 1):
        with open(path, "ab") as file:
            file.write(record[:cut])
        assert [event for _, event in reader.read_available()] == [line(0, 0)][
            : 1 if cut == 1 else 0
        ]
        with open(path, "rb+") as file:  # take the partial record back
            file.truncate(os.path.getsize(path) - cut)
    with open(path, "ab") as file:
        file.write(record)
    assert [event for _, event in reader.read_available()] == [Result(0, 42)]


def test_an_error_that_does_not_pickle_arrives_as_its_message(tmp_path):
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    writer = EventLogWriter(tmp_path)
    writer.append(RunEnded(Unpicklable("the cause")))
    ((_, ended),) = EventLogReader(tmp_path).read_available()
    assert isinstance(ended.error, RuntimeError)
    assert "Unpicklable: the cause" in str(ended.error)


def shown(report: RunReport) -> list[tuple]:
    return [(kept.rank, kept.text, kept.stderr) for kept in report.output()]


@pytest.mark.parametrize("read_during", [False, True])
def test_the_log_stays_bounded_and_keeps_what_the_report_shows(tmp_path, read_during):
    """A chatty run: each segment is rewritten with what is kept once it passes its size. A
    reader that follows all along and one that starts at the end fold the same report as
    the writer's events do (the newest output lines of each rank, every metric)."""
    writer = EventLogWriter(tmp_path, segment_bytes=64 * 1024)
    follower = EventLogReader(tmp_path)
    followed = RunReport(main_rank=0)
    everything = RunReport(main_rank=0)
    for number in range(3 * MAX_RANK_LINES):
        for event in (line(0, number), line(1, number), Progress(0, number, None, 0.0)):
            writer.append(event)
            everything.apply(event)
        if number % 50 == 0:
            record = MetricRecord(number, 0, {"loss": 1 / (number + 1)}, 0.0)
            writer.append(record)
            everything.apply(record)
        if read_during and number % 97 == 0:
            for _, event in follower.read_available():
                followed.apply(event)
    for _, event in follower.read_available():
        followed.apply(event)
    late = RunReport(main_rank=0)
    for _, event in EventLogReader(tmp_path).read_available():
        late.apply(event)

    assert len(segments(tmp_path)) == 1 and segments(tmp_path)[0] > 0
    size = os.path.getsize(run_log.segment_path(tmp_path, segments(tmp_path)[0]))
    assert size <= writer.limit
    for report in (followed, late):
        assert shown(report) == shown(everything)
        assert report.metrics == everything.metrics
        assert report.progress == everything.progress
