"""Where a run's events go in the launching process, after its report has them.

The launcher folds each event into the run's report (reporting/report.py) and
then hands both to an observer; the default one prints worker output to this
process's stdout and stderr (the running cell, in a notebook). Other views,
such as a live progress display or the control panel, are observers too, and
draw the report.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from notebook_accel.reporting.events import OutputLine, RanksStuck, Restarting, RunEnded
from notebook_accel.reporting.report import RunReport, rank_prefix

if TYPE_CHECKING:
    from notebook_accel.reporting.events import RunEvent

OUTPUT_CHOICES = ("all", "main", "none")


class RunObserver:
    """Receives a run's events (reporting/events.py), each after the run's report took it in."""

    def on_event(self, event: RunEvent, report: RunReport) -> None:
        """Called once per event, in order, from the thread that runs the launch."""


class ConsoleObserver(RunObserver):
    """Writes worker output to sys.stdout/sys.stderr, other ranks prefixed."""

    def __init__(self, output: str = "all", main_rank: int = 0):
        self.output = output
        self.main_rank = main_rank

    def on_event(self, event: RunEvent, report: RunReport) -> None:
        if isinstance(event, OutputLine):
            self._write_line(event)
        elif isinstance(event, Restarting):
            self._announce_restart(event)
        elif isinstance(event, RanksStuck):
            sys.stderr.write(event.text)
            sys.stderr.flush()

    def _write_line(self, event: OutputLine) -> None:
        if self.output == "none" or (self.output == "main" and event.rank != self.main_rank):
            return
        target = sys.stderr if event.stream == "stderr" else sys.stdout
        target.write(rank_prefix(event.rank, self.main_rank) + event.line)
        target.flush()

    def _announce_restart(self, event: Restarting) -> None:
        # The cause first (which rank, and how it ended), then what happens next.
        failures = getattr(event.error, "failures", None)
        cause = failures[0].describe() if failures else str(event.error).splitlines()[0]
        sys.stderr.write(
            f"notebook_accel: {cause}; restarting every worker (restart {event.attempt}); "
            "a function that calls load_state() continues from its newest checkpoint\n"
        )
        sys.stderr.flush()


class ObserverGroup(RunObserver):
    """Forwards every event to several observers, in order."""

    def __init__(self, observers: list[RunObserver]):
        self.observers = observers

    def on_event(self, event: RunEvent, report: RunReport) -> None:
        if not isinstance(event, RunEnded):
            for observer in self.observers:
                observer.on_event(event, report)
            return
        # Every view gets the end, and a view that fails drawing it must not
        # replace the run's own error on its way to the caller.
        for observer in self.observers:
            try:
                observer.on_event(event, report)
            except Exception as failure:  # noqa: BLE001
                warnings.warn(
                    f"{type(observer).__name__} could not show the end of the run: {failure!r}",
                    stacklevel=2,
                )


class RunFeed(ObserverGroup):
    """Where a run's events come in: each is folded into the run's report, then handed
    with it to every observer, in order. The attached launch, live workers, a detached
    run's keeper and whoever follows that run all take their events in through one."""

    def __init__(self, report: RunReport, observers: list[RunObserver] | None = None) -> None:
        super().__init__(observers if observers is not None else [])
        self.report = report

    def __call__(self, event: RunEvent) -> None:
        self.report.apply(event)
        self.on_event(event, self.report)
