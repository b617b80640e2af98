"""The base of every view of a run: it draws the run's report, at a bounded rate.

A view keeps no copy of the run: the launcher folds each event into the
run's report (reporting/report.py) and then hands both to the view, which
redraws from the report. Kept free of widgets so that the live display, the
text display and the panel share it, and so that it can be tested without a
front end.
"""

from __future__ import annotations

import threading
import time

from notebook_accel.reporting.events import AttemptStarted, RunEnded, RunEvent, WorkerExited
from notebook_accel.reporting.observers import RunObserver
from notebook_accel.reporting.report import RunReport

# Events that change what a view shows at once (a worker's chip, the outcome).
_REDRAW_NOW = (AttemptStarted, WorkerExited)


class RunView(RunObserver):
    """Draws one run's report; subclasses redraw in `changed()`.

    `changed(final)` is called at most every `interval` seconds while the run
    goes (at once when workers start or exit), and once with `final=True`
    when it ends. `report` is the run's report once the first event came.
    `periodic` is True while `changed()` runs as one of these redraws during the
    run: the next one, or the end, draws what a costly part skips now. Other
    calls (a live group's call ended) should draw everything.
    """

    interval = 0.25

    def __init__(self) -> None:
        self.report: RunReport | None = None
        self._last_change = 0.0
        # The thread inside a periodic redraw: another thread's call to changed() (a
        # live group's call ended, the panel) is not one, even while that one runs.
        self._periodic_thread: int | None = None

    @property
    def periodic(self) -> bool:
        return self._periodic_thread == threading.get_ident()

    def on_event(self, event: RunEvent, report: RunReport) -> None:
        self.report = report
        if isinstance(event, RunEnded):
            self.changed(final=True)
            return
        now = time.monotonic()
        if isinstance(event, _REDRAW_NOW) or now - self._last_change >= self.interval:
            self._last_change = now
            self._periodic_thread = threading.get_ident()
            try:
                self.changed(final=False)
            finally:
                self._periodic_thread = None

    def changed(self, final: bool) -> None:
        """Redraw from `self.report`; called at most every `interval` seconds and at the end."""
