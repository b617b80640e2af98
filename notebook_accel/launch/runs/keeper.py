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
import os
import signal
import sys
from pathlib import Path
from typing import Any

from notebook_accel.launch.launcher import run_plan
from notebook_accel.launch.runs.directory import RunDirectory
from notebook_accel.launch.runs.log import EventLogWriter
from notebook_accel.launch.runs.starting import ENV_RESUME_FROM, read_plan
from notebook_accel.reporting.events import CheckpointSaved, RunEnded, RunEvent
from notebook_accel.reporting.observers import RunObserver


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


def keeper_main(path: str) -> None:
    """The keeper process: run the launch in the run directory `path`, then exit."""
    directory = RunDirectory(Path(path))
    # `kill PID` stops the run as a stop press does; the keeper has no terminal.
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    writer = EventLogWriter(directory.path)
    ended: RunEnded | None = None
    status = "lost"
    try:
        plan, resume_from = read_plan(directory)
        if resume_from:
            os.environ[ENV_RESUME_FROM] = resume_from
        # Nothing launches from this process after the run: warming would only cost time.
        plan = dataclasses.replace(plan, warm=False)
        report = plan.new_report()
        report.started_at = directory.read().created
        try:
            run_plan(plan, _LogObserver(directory, writer), report=report)
        except BaseException as error:  # noqa: BLE001 - the report and the log say how it ended
            ended = RunEnded(error)
        else:
            ended = RunEnded(None)
        status = report.status
    except BaseException as error:  # noqa: BLE001 - the plan could not even be read
        ended = RunEnded(error)
        status = "failed"
        print(f"the run could not start: {error!r}", file=sys.stderr)
    finally:
        final = ended or RunEnded(RuntimeError("the keeper ended before the run did"))
        directory.update(
            state=status,
            ended=final.time,
            error=None if final.error is None else str(final.error).splitlines()[0][:500],
        )
        writer.append(final)
        writer.close()
