"""What a view knows about a run, built from the launcher's events.

Kept free of widgets so that the live display, the text display and the
panel share it, and so that it can be tested without a front end.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from notebook_accel.launch.observers import RunObserver, rank_prefix
from notebook_accel.metrics import MetricRecord

MAX_CURVE_POINTS = 2000
MAX_LOG_LINES = 500


class RunState(RunObserver):
    """Collects a run's events; subclasses redraw in `changed()`.

    `changed(final)` is called at most every `interval` seconds while the run
    goes, and once with `final=True` when it ends.
    """

    interval = 0.25

    def __init__(self, main_rank: int = 0) -> None:
        self.main_rank = main_rank
        self.workers = 0
        self.statuses: dict[int, str] = {}
        self.progress: dict[str, Any] | None = None
        self.latest: dict[str, float | str] = {}
        self.curves: dict[str, list[tuple[float, float]]] = {}
        self.resources: dict[int, dict[str, int]] = {}
        self.logs: deque[str] = deque(maxlen=MAX_LOG_LINES)
        self.outcome: str = ""
        self.error: BaseException | None = None
        self.has_live_data = False
        self._last_change = 0.0
        self._count = 0

    # -- events ----------------------------------------------------------------

    def on_start(self, workers: int, attempt: int) -> None:
        # This machine's workers: global ranks main_rank .. main_rank + workers - 1.
        self.workers = workers
        first = self.main_rank
        self.statuses = {rank: "running" for rank in range(first, first + workers)}
        if attempt:
            self.logs.append(f"--- restart {attempt} ---\n")
        self.outcome = "running"
        self._changed(force=True)

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.logs.append(rank_prefix(rank, self.main_rank) + line)
        self._changed()

    def on_message(self, rank: int, kind: str, payload: Any) -> None:
        if kind == "progress" and rank == self.main_rank:
            self.progress = payload
            self.has_live_data = True
        elif kind == "metric":
            self._add_metric(payload)
            self.has_live_data = True
        elif kind == "resources":
            self.resources.setdefault(rank, {}).update(payload)
        else:
            return
        self._changed()

    def on_worker_exit(self, rank: int, exitcode: int) -> None:
        self.statuses[rank] = "finished" if exitcode == 0 else "failed"
        self._changed(force=True)

    def on_restart(self, attempt: int, error: BaseException) -> None:
        self.logs.append(f"restarting after: {str(error).splitlines()[0]}\n")

    def on_end(self, error: BaseException | None) -> None:
        self.error = error
        if error is None:
            self.outcome = "finished"
        elif isinstance(error, KeyboardInterrupt):
            self.outcome = "stopped"
        elif isinstance(error, TimeoutError):
            self.outcome = "timed out"
        else:
            self.outcome = "failed"
        for rank, status in self.statuses.items():
            if status == "running":
                self.statuses[rank] = "stopped" if error is not None else "finished"
        self.changed(final=True)

    # -- derived ---------------------------------------------------------------

    def curve_name(self) -> str | None:
        """The metric the chart shows: the first with 'loss' in its name, else the first."""
        names = list(self.curves)
        for name in names:
            if "loss" in name.lower():
                return name
        return names[0] if names else None

    def _add_metric(self, record: MetricRecord) -> None:
        self._count += 1
        step = record.step if record.step is not None else self._count
        for name, value in record.values.items():
            self.latest[name] = value
            if isinstance(value, float) and record.rank == self.main_rank:
                points = self.curves.setdefault(name, [])
                points.append((float(step), value))
                if len(points) > MAX_CURVE_POINTS:  # keep every other point
                    del points[::2]

    def _changed(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_change >= self.interval:
            self._last_change = now
            self.changed(final=False)

    def changed(self, final: bool) -> None:
        """Redraw; called at most every `interval` seconds and once at the end."""
