"""The keeper: the process that owns a detached run's workers instead of the kernel.

Started by starting.py. It runs the launch exactly as the kernel would
(`run_plan`): it forks the workers, and its janitor and their parent-death
signal end them if the keeper itself is killed. Every event goes to the run's
log (log.py) instead of a cell; the record (run.json) says how it ended.

A stop from any kernel is SIGINT (or SIGTERM) to the keeper: the launch then
stops every worker, as the stop button does in a cell, and the run ends
"stopped".
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any

from notebook_accel.launch.running import run_plan
from notebook_accel.launch.runs.directory import RunDirectory
from notebook_accel.launch.runs.log import EventLogWriter
from notebook_accel.launch.runs.starting import read_plan
from notebook_accel.reporting.events import CheckpointSaved, RunEnded, RunEvent
from notebook_accel.reporting.observers import RunObserver
from notebook_accel.reporting.report import final_status


class _LogObserver(RunObserver):
    """Appends every event to the run's log; the record gets the newest checkpoint."""

    def __init__(self, directory: RunDirectory, writer: EventLogWriter) -> None:
        self.directory = directory
        self.writer = writer

    def on_event(self, event: RunEvent, report: Any) -> None:
        if isinstance(event, RunEnded):
            return  # written by keeper_main, after the record says how the run ended
        self.writer.append(event)
        if isinstance(event, CheckpointSaved):
            self.directory.update(checkpoint=event.path)
        elif report.status == "running" and self.directory.read().state == "starting":
            self.directory.update(state="running")


def keeper_main(path: str, stops: list[int] | None = None) -> None:
    """The keeper process: run the launch in the run directory `path`, then exit.

    `stops`: the stop signals that came before this could act on them (the run then
    ends "stopped" before any worker starts)."""
    directory = RunDirectory(Path(path))
    writer = EventLogWriter(directory.path)
    ended = RunEnded(RuntimeError("the keeper ended before the run did"))
    status = "lost"
    try:
        # From here a stop raises KeyboardInterrupt (until run_plan turns it into a clean
        # stop of the workers); `kill PID` stops the run as a stop press does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the keeper has no terminal
        if stops:
            raise KeyboardInterrupt("the run was stopped before its workers started")
        plan = read_plan(directory)
        # Nothing launches from this process after the run: warming would only cost time.
        plan = dataclasses.replace(plan, warm=False)
        report = plan.new_report()
        report.started_at = directory.read().created
        run_plan(plan, _LogObserver(directory, writer), report=report)
        ended, status = RunEnded(None), "finished"
    except BaseException as error:  # noqa: BLE001 - the record and the log say how it ended
        ended, status = RunEnded(error), final_status(error)
        if status == "failed" and not hasattr(error, "failures"):  # not the workers' error
            print(f"the run could not start: {error!r}", file=sys.stderr)
    finally:
        directory.update(
            state=status,
            ended=ended.time,
            error=None if ended.error is None else str(ended.error).splitlines()[0][:500],
        )
        writer.append(ended)
        writer.close()
