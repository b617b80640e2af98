"""A run's report, and the one reducer that folds the run's events into it.

Every event of a run (events.py) goes through `RunReport.apply` before any
observer sees it, so the launcher's history (`last_run()`), the live view
under a cell, the text view of a script and the panel all read the same
report instead of keeping copies of their own. Each run has its own report.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from notebook_accel.reporting.events import (
    AttemptStarted,
    CheckpointSaved,
    MetricRecord,
    ModulesImported,
    OutputLine,
    PeakResources,
    Progress,
    ResourceSample,
    Restarting,
    Result,
    RunEnded,
    RunEvent,
    WorkerExited,
)

# The curve a view draws keeps at most this many points (every other one is
# dropped when it is full); the log view keeps this many of the newest lines.
MAX_CURVE_POINTS = 2000
MAX_LOG_LINES = 500
# The output per rank keeps each rank's newest lines (so a chatty rank cannot push
# the others' out), and each line's first characters.
MAX_RANK_LINES = 1000
MAX_LINE_CHARS = 2000

FINAL_STATUSES = ("finished", "failed", "stopped", "timed out")


def rank_prefix(rank: int, main_rank: int) -> str:
    """What goes before a worker's output line: nothing for the main rank."""
    return "" if rank == main_rank else f"[rank {rank}] "


@dataclass(frozen=True)
class LogLine:
    """One line of the run's output, as the output per rank keeps it.

    `index` counts the run's lines in arrival order; `rank` is the worker's global
    rank, or None for the launcher's own lines (a restart's separator), which every
    rank's view shows; `text` has no newline (a line a progress bar redrew with
    carriage returns keeps only what a terminal would show last); `stderr` says
    whether the worker wrote it to its stderr.
    """

    index: int
    rank: int | None
    text: str
    stderr: bool = False


def _shown_text(line: str) -> str:
    text = line.rstrip("\n")
    if "\r" in text:  # what a terminal would show: the last redraw
        parts = [part for part in text.split("\r") if part]
        text = parts[-1] if parts else ""
    if len(text) > MAX_LINE_CHARS:
        text = text[:MAX_LINE_CHARS] + f" ... [{len(text) - MAX_LINE_CHARS} more characters]"
    return text


@dataclass
class Warming:
    """What this process imported for a run so that the next launch's workers have it.

    `status`: "not started", "off" (the launch passed warm=False, or warming
    cannot run here: `problem` says why), "not needed" (the function ran in
    this process), "running" (modules are being imported, on the thread that
    runs the notebook's code), "done", "deferred" (left to the Jupyter
    kernel's event loop, between cells: `wait()` for it), "next launch" (left
    to the next launch on the main thread, outside a kernel), "interrupted" (a
    stop press ended it), "stopped" (an import started a device runtime:
    `problem` says which; the next launch refuses, and warming stays off in
    this process), "on the cluster" (the workers ran on a Ray cluster, whose
    agents import what their workers had to import, after each run:
    launch/cluster/agent.py), or "in the template" (start method "forkserver":
    the process the workers fork from imports it, launch/template.py).

    `modules` are the modules imported here on purpose, in order (a launch
    imports, before its workers start, what earlier launches left: it is
    counted in its own report); `imported` counts every module that brought
    in; `seconds` is what it took (once, instead of in every worker of every
    launch). `skipped` maps a module left alone to the reason.
    """

    status: str = "not started"
    modules: list[str] = field(default_factory=list)
    imported: int = 0
    seconds: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    pending: list[str] = field(default_factory=list, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for deferred warming to end; True once it has
        (or never had to wait). Never call it on the main thread of a kernel whose
        event loop does the deferred imports: that thread would wait for itself."""
        if self.status in ("running", "deferred"):
            return self._finished.wait(timeout)
        return True

    def summary(self) -> str:
        """One line: what was warmed, what it cost, what was skipped."""
        text = (
            f"warming {self.status}: {len(self.modules)} module(s) asked for, "
            f"{self.imported} imported in {self.seconds:.2f} s"
        )
        if self.skipped:
            text += f", {len(self.skipped)} skipped"
        return text + (f" ({self.problem})" if self.problem else "")

    def finish(self, status: str) -> None:
        """Set the final status and wake whoever waits."""
        self.status = status
        self._finished.set()


@dataclass
class RunReport:
    """What one launch did, and is doing while it runs; `last_run()` returns the latest.

    `metrics` holds every `Accelerator.log` record in arrival order;
    `resources` each rank's memory figures (`rss_bytes` from the live samples,
    `peak_rss_bytes` the highest seen, and on GPUs `peak_gpu_bytes` at the
    end); `progress` the main process's latest progress-bar position
    (`step`, `total`, `elapsed`); `results` the values workers returned
    (tensors on the CPU). For views it also keeps each rank's status, the
    latest value of every metric, the chart's curves (thinned) and the newest
    output lines (`logs`: every rank's, prefixed; `output()`: each rank's own,
    with their stream). `imported_by_workers` maps each module a worker had to
    import itself to its file; `warming` says which of them this process imported
    afterwards for the next launch, what that cost and what was skipped
    (launch/warm.py; filled in by a background thread, see `Warming.wait`).
    """

    status: str = "starting"  # starting, running, finished, failed, stopped, timed out
    world_size: int = 0
    backend: str = ""
    mixed_precision: str = "no"
    # How the workers started: "fork", "forkserver" (from a clean process), "spawn"
    # (fresh interpreters) or "in process".
    start_method: str = ""
    results: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    restarts: int = 0
    started_at: float = 0.0
    duration: float = 0.0
    metrics: list[MetricRecord] = field(default_factory=list)
    resources: dict[int, dict[str, int]] = field(default_factory=dict)
    progress: dict[str, Any] | None = None
    # The first global rank on this machine: its output is not prefixed, its
    # progress and curve are the ones shown.
    main_rank: int = 0
    workers: int = 0
    statuses: dict[int, str] = field(default_factory=dict)
    latest: dict[str, float | str] = field(default_factory=dict)
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict, repr=False)
    logs: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_LOG_LINES), repr=False)
    # Lines of output received so far (kept or not): a view redraws when it grows.
    lines_received: int = field(default=0, init=False, repr=False)
    # Each rank's newest lines; the key None holds the launcher's separators.
    _output: dict[int | None, deque[LogLine]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # A view may read the output on another thread (the panel's rank filter) than
    # the one that folds the events in.
    _output_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )
    imported_by_workers: dict[str, str | None] = field(default_factory=dict, repr=False)
    # The newest complete checkpoint the main worker saved (Accelerator.save_state).
    checkpoint: str | None = None
    warming: Warming = field(default_factory=Warming)

    # -- the reducer -----------------------------------------------------------

    def apply(self, event: RunEvent) -> None:
        """Fold one event of the run into this report.

        A worker's error (`WorkerRaised`) steers the supervisor and changes
        nothing here: the run's own error arrives with `RunEnded`.
        """
        fold = _FOLDS.get(type(event))
        if fold is not None:
            fold(self, event)

    def _attempt_started(self, event: AttemptStarted) -> None:
        # This machine's workers: global ranks main_rank .. main_rank + workers - 1.
        self.workers = event.workers
        self.statuses = {
            rank: "running" for rank in range(self.main_rank, self.main_rank + event.workers)
        }
        self.results = {}  # a failed attempt's values are not the run's
        if event.attempt:
            self._notice(f"--- restart {event.attempt} ---\n")
        self.status = "running"

    def _output_line(self, event: OutputLine) -> None:
        self.logs.append(rank_prefix(event.rank, self.main_rank) + event.line)
        self._keep_line(event.rank, event.line, stderr=event.stream == "stderr")

    def _notice(self, line: str) -> None:
        """A line of the launcher's own (a restart): in the logs and in every rank's output."""
        self.logs.append(line)
        self._keep_line(None, line, stderr=False)

    def _keep_line(self, rank: int | None, line: str, stderr: bool) -> None:
        with self._output_lock:
            kept = self._output.get(rank)
            if kept is None:
                kept = self._output[rank] = deque(maxlen=MAX_RANK_LINES)
            kept.append(LogLine(self.lines_received, rank, _shown_text(line), stderr))
            self.lines_received += 1

    def _metric(self, record: MetricRecord) -> None:
        self.metrics.append(record)
        step = record.step if record.step is not None else len(self.metrics)
        for name, value in record.values.items():
            self.latest[name] = value
            if isinstance(value, float) and record.rank == self.main_rank:
                points = self.curves.setdefault(name, [])
                points.append((float(step), value))
                if len(points) > MAX_CURVE_POINTS:  # keep every other point, the newest too
                    del points[-2::-2]

    def _progress(self, event: Progress) -> None:
        if event.rank == self.main_rank:
            self.progress = {"step": event.step, "total": event.total, "elapsed": event.elapsed}

    def _resource_sample(self, event: ResourceSample) -> None:
        figures = self.resources.setdefault(event.rank, {})
        figures["rss_bytes"] = event.rss_bytes
        figures["peak_rss_bytes"] = max(figures.get("peak_rss_bytes", 0), event.rss_bytes)

    def _peak_resources(self, event: PeakResources) -> None:
        figures = self.resources.setdefault(event.rank, {})
        figures["peak_rss_bytes"] = max(figures.get("peak_rss_bytes", 0), event.peak_rss_bytes)
        if event.peak_gpu_bytes is not None:
            figures["peak_gpu_bytes"] = max(figures.get("peak_gpu_bytes", 0), event.peak_gpu_bytes)

    def _modules_imported(self, event: ModulesImported) -> None:
        for name, origin in event.modules:
            self.imported_by_workers.setdefault(name, origin)

    def _result(self, event: Result) -> None:
        self.results[event.rank] = event.value

    def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        self.checkpoint = event.path

    def _worker_exited(self, event: WorkerExited) -> None:
        self.statuses[event.rank] = "finished" if event.exitcode == 0 else "failed"

    def _restarting(self, event: Restarting) -> None:
        self.restarts = max(self.restarts, event.attempt)
        self._notice(f"restarting after: {str(event.error).splitlines()[0]}\n")

    def _run_ended(self, event: RunEnded) -> None:
        error = event.error
        self.error = error
        self.status = final_status(error)
        self.duration = max(0.0, event.time - self.started_at) if self.started_at else 0.0
        for rank, status in self.statuses.items():
            if status == "running":
                self.statuses[rank] = "stopped" if error is not None else "finished"

    # -- reading ---------------------------------------------------------------

    @property
    def has_live_data(self) -> bool:
        """Whether the run has reported progress or metrics so far."""
        return self.progress is not None or bool(self.metrics)

    def last_step(self) -> int | None:
        """The main rank's newest step: its progress bar's position, else the step of its
        newest `Accelerator.log` record (a record without one counts as the record's
        place, as on the chart); None before either arrives."""
        if self.progress:
            return self.progress["step"]
        for place in range(len(self.metrics) - 1, -1, -1):
            record = self.metrics[place]
            if record.rank == self.main_rank:
                return record.step if record.step is not None else place + 1
        return None

    def curve_name(self) -> str | None:
        """The metric a chart shows: the first with 'loss' in its name, else the first."""
        for name in self.curves:
            if "loss" in name.lower():
                return name
        return next(iter(self.curves), None)

    def output(
        self, rank: int | None = None, last: int | None = None, since: int = 0
    ) -> list[LogLine]:
        """The workers' output lines on this machine, in arrival order.

        `rank`: only that rank's lines (the restarts' separators included); None:
        every rank's, interleaved as they arrived. `last`: only the newest that many.
        `since`: only lines received after the first `since` (`lines_received` when a
        live group's call began: that call's lines). Each rank keeps its newest
        MAX_RANK_LINES lines.
        """
        with self._output_lock:
            keys = list(self._output) if rank is None else [None, rank]
            parts = [
                [line for line in self._output.get(key, ()) if line.index >= since] for key in keys
            ]
        if last is not None:
            if last <= 0:
                return []
            parts = [part[-last:] for part in parts]  # the newest overall are among these
        lines = list(heapq.merge(*parts, key=lambda line: line.index))
        return lines if last is None else lines[-last:]

    def output_ranks(self) -> list[int]:
        """The ranks that have written output, in order."""
        with self._output_lock:
            return sorted(rank for rank in self._output if rank is not None)

    def history(self, name: str, rank: int | None = None) -> list[tuple[int | None, Any]]:
        """(step, value) pairs of one metric, in the order they were logged."""
        return [
            (r.step, r.values[name])
            for r in self.metrics
            if name in r.values and (rank is None or r.rank == rank)
        ]

    def to_dataframe(self) -> Any:
        """The metric history as a pandas DataFrame: step, rank, time, one column per metric."""
        try:
            import pandas
        except ImportError:
            raise ImportError("to_dataframe() needs pandas: pip install pandas") from None
        rows = [{"step": r.step, "rank": r.rank, "time": r.time, **r.values} for r in self.metrics]
        return pandas.DataFrame(rows)


def final_status(error: BaseException | None) -> str:
    """How a run that ended with `error` ended: one of FINAL_STATUSES."""
    if error is None:
        return "finished"
    if isinstance(error, KeyboardInterrupt):
        return "stopped"
    if isinstance(error, TimeoutError):
        return "timed out"
    return "failed"


_FOLDS: dict[type, Callable[[RunReport, Any], None]] = {
    AttemptStarted: RunReport._attempt_started,
    OutputLine: RunReport._output_line,
    MetricRecord: RunReport._metric,
    Progress: RunReport._progress,
    ResourceSample: RunReport._resource_sample,
    PeakResources: RunReport._peak_resources,
    ModulesImported: RunReport._modules_imported,
    Result: RunReport._result,
    WorkerExited: RunReport._worker_exited,
    CheckpointSaved: RunReport._checkpoint_saved,
    Restarting: RunReport._restarting,
    RunEnded: RunReport._run_ended,
}
