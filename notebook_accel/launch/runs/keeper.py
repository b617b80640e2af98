"""The keeper: what owns a detached run's workers instead of the kernel.

It runs the launch as the kernel would (`run_plan`); every event goes to the
run's log (log.py) instead of a cell, and the run's record says how it ended.
One body, `Keeper`; only where the events and the record go differs: a process
of this machine, its run directory (`LocalKeeper`, started by local.py), or
a detached Ray actor, its memory (`ClusterKeeper`, on_cluster.py).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from typing import Any

from notebook_accel.launch.running import run_plan
from notebook_accel.launch.runs.directory import RunDirectory
from notebook_accel.launch.runs.log import EventLog, EventLogWriter
from notebook_accel.launch.supervisor import StopSignal
from notebook_accel.reporting.events import CheckpointSaved, RunEnded, RunEvent
from notebook_accel.reporting.observers import RunObserver
from notebook_accel.reporting.report import final_status


class Keeper(RunObserver):
    """Runs one detached run to its end: every event into `log`, the newest checkpoint
    and how the run ended into its record."""

    def __init__(self, log: EventLog, stop: StopSignal | None = None) -> None:
        self.log = log
        self.stop_signal = stop
        self.lock = threading.Lock()  # kernels read the log while the run appends
        self._said_running = False

    def keep(self, started_at: float) -> None:
        """Run the launch to its end; its record and its log say how it ended."""
        ended, status = RunEnded(RuntimeError("the keeper ended before the run did")), "lost"
        try:
            # Nothing launches from the keeper after the run: warming would only cost time.
            plan = dataclasses.replace(self.plan(), warm=False)
            run_plan(
                plan, self, stop=self.stop_signal, report=plan.new_report(started_at=started_at)
            )
            ended, status = RunEnded(None), "finished"
        except BaseException as error:  # noqa: BLE001 - the record and the log say how it ended
            ended, status = RunEnded(error), final_status(error)
            if status == "failed" and not hasattr(error, "failures"):  # not the workers' error
                print(f"the run could not start: {error!r}", file=sys.stderr)
        finally:
            why = None if ended.error is None else str(ended.error).split("\n", 1)[0][:500]
            self.update_record(state=status, ended=ended.time, error=why)
            self._append(ended)
            self.log.close()

    def on_event(self, event: RunEvent, report: Any) -> None:
        if isinstance(event, RunEnded):
            return  # appended by keep(), once the record says how the run ended
        self._append(event)
        if isinstance(event, CheckpointSaved):
            self.update_record(checkpoint=event.path)
        elif report.status == "running" and not self._said_running:
            self._said_running = True
            self.update_record(state="running")

    def _append(self, event: RunEvent) -> None:
        with self.lock:
            self.log.append(event)

    # -- what each place provides: the launch as it runs there, the run's record

    def plan(self) -> Any:
        """The launch plan, as it runs here."""

    def update_record(self, **changes: Any) -> None:
        """Change the run's record's fields as `changes` say."""


class LocalKeeper(Keeper):
    """The keeper process of a run of this machine, its run directory. Its janitor and the
    workers' parent-death signal end them if the keeper is killed; a stop from any kernel
    is SIGINT (or SIGTERM) to it, and the run then ends "stopped"."""

    def __init__(self, directory: RunDirectory, stops: list[int] | None = None) -> None:
        super().__init__(EventLogWriter(directory.path))
        self.directory = directory
        self._stops = stops

    def plan(self) -> Any:
        # From here a stop raises KeyboardInterrupt (until run_plan turns it into a clean
        # stop of the workers); `kill PID` stops the run as a stop press does.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the keeper has no terminal
        if self._stops:
            raise KeyboardInterrupt("the run was stopped before its workers started")
        return self.directory.read_plan()

    def update_record(self, **changes: Any) -> None:
        self.directory.update(**changes)


def keeper_main(path: str, stops: list[int] | None = None) -> None:
    """The keeper process: run the launch in the run directory `path`, then exit.

    `stops`: the stop signals that came before this could act on them (the run then
    ends "stopped" before any worker starts)."""
    directory = RunDirectory(path)
    LocalKeeper(directory, stops).keep(started_at=directory.read().created)
