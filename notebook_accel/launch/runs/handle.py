"""A detached run seen from a kernel: follow it, stop it, get its result; find runs.

`DetachedRun` replays the run's log (log.py) into a report of its own, the
same `RunReport` a launch fills, and then follows the log as the keeper
appends to it. Any kernel of the user can do this, any number of times: the
run does not know who watches. The run's outcome is the launch's: the main
worker's value, or the `WorkerError` (with the rank's traceback), a
`TimeoutError`, or `KeyboardInterrupt` for a run that was stopped; a run whose
keeper died before the end raises `RunLostError`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from notebook_accel.launch.runs.directory import (
    RunDirectory,
    RunRecord,
    find_run,
    run_directories,
)
from notebook_accel.launch.runs.log import EventLogReader
from notebook_accel.launch.runs.starting import (
    ENV_RESUME_FROM,
    read_plan,
    start_keeper,
    write_plan,
)
from notebook_accel.reporting.events import RunEnded
from notebook_accel.reporting.observers import ConsoleObserver, ObserverGroup, RunObserver
from notebook_accel.reporting.report import RunReport, rank_prefix

# How often a follower looks for new events (the keeper appends as they come).
POLL_SECONDS = 0.1
# How often a follower that finds nothing new checks that the keeper still runs.
KEEPER_CHECK_SECONDS = 1.0
# How long stop() waits for the run to end once its keeper was told.
STOP_SECONDS = 60.0


class RunLostError(RuntimeError):
    """The run's keeper process ended before the run did (it was killed, or the machine
    restarted); its workers were stopped with it. `checkpoint` is the newest checkpoint
    the run saved, if any: `resume(run_id)` goes on from it."""

    def __init__(self, run_id: str, checkpoint: str | None, why: str = "") -> None:
        self.run_id, self.checkpoint, self.why = run_id, checkpoint, why
        then = (
            f'resume("{run_id}") starts it again from its newest checkpoint, {checkpoint}'
            if checkpoint
            else "It saved no checkpoint (Accelerator.save_state) to resume from"
        )
        super().__init__(
            f"run {run_id} was lost: its keeper process ended before the run did"
            + (f" ({why})" if why else "")
            + f"; its workers were stopped. {then}."
        )

    def __reduce__(self):
        return (type(self), (self.run_id, self.checkpoint, self.why))


class DetachedRun:
    """A run that does not end with the kernel (`notebook_launcher(..., detach=True)`,
    `attach()`).

    `report` is the run's report, as `last_run()` gives for a launch, kept up to
    date while someone follows the run (`wait`, `result`, or the view shown
    under the cell that started or attached it). `result()` waits for the end
    and returns the main worker's value (every worker's with `return_all`) or
    raises the run's error; `stop()` stops it, from any kernel.

    One subclass per place a keeper runs: `LocalRun` (a process of this
    machine, its run directory) and `ClusterRun` (a detached actor of a Ray
    cluster, runs/on_cluster.py).
    """

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.report = RunReport(
            world_size=record.world_size,
            backend=record.backend,
            mixed_precision=record.mixed_precision,
            start_method=record.start_method,
            main_rank=record.main_rank,
            started_at=record.created,
        )
        self.report.checkpoint = record.checkpoint
        self._observers = ObserverGroup([])
        self._lock = threading.Lock()  # one follower reads the log at a time
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._keeper_checked = 0.0

    @property
    def id(self) -> str:
        """The run's id: what `attach`, `resume` and `runs()` name it by."""
        return self.record.id

    @property
    def state(self) -> str:
        """ "starting", "running", "finished", "failed", "stopped", "timed out" or "lost"."""
        if self._ended.is_set():
            return "lost" if isinstance(self.report.error, RunLostError) else self.report.status
        return self._state_now()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}: {self.record.function}, {self.state}>"

    # -- what each place of keepers provides -------------------------------------

    def _read_new(self) -> list[tuple[int, Any]]:
        """The events the keeper logged since the last call."""
        raise NotImplementedError

    def _keeper_gone(self) -> bool:
        """Whether the keeper no longer runs (it can log nothing more)."""
        raise NotImplementedError

    def _on_lost(self) -> str:
        """Record the loss where the run is kept; return why it was lost, if known."""
        return ""

    def _state_now(self) -> str:
        raise NotImplementedError

    def _ask_to_stop(self) -> bool:
        """Tell the keeper to stop the run; False if it is gone already."""
        raise NotImplementedError

    def _after_stop(self, seconds: float) -> None:
        """Wait at most `seconds` for the keeper to be gone once the run ended stopped."""

    # -- following -----------------------------------------------------------

    def poll(self) -> bool:
        """Take in what the run did since the last call; True once it has ended."""
        with self._lock:
            if self._ended.is_set():
                return True
            if self._take_new():
                return True
            now = time.monotonic()
            if now - self._keeper_checked < KEEPER_CHECK_SECONDS:
                return False
            self._keeper_checked = now
            if not self._keeper_gone():
                return False
            if self._take_new():  # what the keeper logged before it went
                return True
            why = self._on_lost()
            self._take(RunEnded(RunLostError(self.id, self.report.checkpoint, why)))
            return True

    def _take_new(self) -> bool:
        for _, event in self._read_new():
            self._take(event)
            if isinstance(event, RunEnded):
                return True
        return False

    def _take(self, event: Any) -> None:
        self.report.apply(event)
        self._observers.on_event(event, self.report)
        if isinstance(event, RunEnded):
            self._ended.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Follow the run until it ends (at most `timeout` seconds); True if it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll():
            if self._thread is not None:  # a view follows it already: wait for that
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._ended.wait(left)
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The run's outcome, as the launch would have given it: wait for the end (at most
        `timeout` s, else TimeoutError), then return the main worker's value or raise."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.id} is still {self.state} after {timeout} s")
        if self.report.error is not None:
            raise self.report.error
        record = self.record
        if record.return_all:
            first = record.main_rank
            return [
                self.report.results.get(r) for r in range(first, first + record.local_world_size)
            ]
        return self.report.results.get(record.main_rank)

    def add_observer(self, observer: RunObserver) -> None:
        """Hand `observer` every event from now on, as whoever follows the run reads it
        (the events so far, if nobody has read them yet)."""
        self._observers.observers.append(observer)

    def follow_in_background(self, observer: RunObserver) -> None:
        """Hand every event, those so far first, to `observer` on a thread of its own."""
        self.add_observer(observer)

        def follow() -> None:
            while not self.poll():
                time.sleep(POLL_SECONDS)

        self._thread = threading.Thread(target=follow, name=f"run {self.id}", daemon=True)
        self._thread.start()

    def output(self, rank: int | None = None) -> str:
        """The output so far of `rank` (every rank's when None), as lines of text."""
        self.poll()
        main = self.report.main_rank

        def shown(line: Any) -> str:
            if rank is None and line.rank is not None:
                return rank_prefix(line.rank, main) + line.text
            return line.text

        return "\n".join(shown(line) for line in self.report.output(rank=rank))

    # -- stopping --------------------------------------------------------------

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the run from this kernel (it needs nothing else: any kernel of the user
        can): every worker is stopped, the run ends "stopped" and its keeper exits.
        Waits at most `timeout` s for that; a run that has ended already is left as it is."""
        deadline = time.monotonic() + timeout
        if self.poll() or not self._ask_to_stop():
            return
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.id} did not stop within {timeout} s")
        self._after_stop(max(0.0, deadline - time.monotonic()))

    def resume(self) -> DetachedRun:
        """Start this run's function again, detached, from the newest checkpoint it saved:
        in the workers, `resume_checkpoint()` gives that directory (for
        `accelerator.load_state`). For a run that ended without finishing."""
        self.poll()
        state = self.state
        if state in ("starting", "running", "finished"):
            raise RuntimeError(
                f"run {self.id} is {state}: only a run that was lost, failed or stopped is "
                "resumed (stop() it first to start over from its checkpoint)"
            )
        return self._relaunch(self.report.checkpoint)

    def _relaunch(self, checkpoint: str | None) -> DetachedRun:
        raise NotImplementedError


class LocalRun(DetachedRun):
    """A detached run whose keeper is a process of this machine (runs/keeper.py); its
    events, record and shipped launch are in its run directory (`directory`)."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory
        super().__init__(directory.read())
        self._reader = EventLogReader(directory.path)

    def _read_new(self) -> list[tuple[int, Any]]:
        found = self._reader.read_available()
        if any(isinstance(event, RunEnded) for _, event in found):
            self._reader.close()
        return found

    def _keeper_gone(self) -> bool:
        return self.directory.state() == "lost"

    def _on_lost(self) -> str:
        # The keeper can no longer write the record: the first to see the loss does.
        self.record = self.directory.update(state="lost", ended=time.time())
        return self.directory.keeper_log_tail(1)

    def _state_now(self) -> str:
        return self.directory.state()

    def _ask_to_stop(self) -> bool:
        self._keeper = self.directory.keeper()
        if self._keeper is None:
            return False
        with contextlib.suppress(psutil.NoSuchProcess):
            self._keeper.send_signal(signal.SIGINT)
        return True

    def _after_stop(self, seconds: float) -> None:
        try:
            self._keeper.wait(seconds)
        except psutil.TimeoutExpired:
            raise TimeoutError(f"run {self.id}'s keeper did not exit within its stop") from None
        except psutil.NoSuchProcess:
            pass

    def _relaunch(self, checkpoint: str | None) -> DetachedRun:
        plan, earlier_resume = read_plan(self.directory)
        return start_detached(plan, resume_from=checkpoint or earlier_resume, resumed_from=self.id)


def start_detached(
    plan: Any, resume_from: str | None = None, resumed_from: str | None = None
) -> DetachedRun:
    """Start a checked launch plan under a keeper process; return its handle at once."""
    directory = RunDirectory.create(
        function=getattr(plan.function, "__qualname__", repr(plan.function)),
        world_size=plan.world_size,
        main_rank=plan.node_rank * plan.local_world_size,
        local_world_size=plan.local_world_size,
        return_all=plan.return_all,
        output=plan.output,
        backend=plan.settings.backend,
        mixed_precision=plan.settings.mixed_precision,
        start_method=plan.start_method,
        checkpoint=resume_from,
        resumed_from=resumed_from,
    )
    write_plan(directory, plan, resume_from)
    start_keeper(directory)
    return LocalRun(directory)


def resume(run_id: str | None = None) -> DetachedRun:
    """Start a lost, failed or stopped run (the newest, or `run_id`) again, detached, from
    the newest checkpoint it saved (`DetachedRun.resume`)."""
    return LocalRun(find_run(run_id)).resume()


def resume_checkpoint() -> str | None:
    """In a worker of a resumed run, the checkpoint to go on from (pass it to
    `accelerator.load_state`); None in a run that starts from scratch."""
    return os.environ.get(ENV_RESUME_FROM) or None


@dataclass(frozen=True)
class RunSummary:
    """One line of `runs()`."""

    id: str
    function: str
    state: str
    started: float
    world_size: int
    checkpoint: str | None

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.id}  {self.state:<9}  {when}  {self.function} x{self.world_size}"


class RunList(list):
    """`runs()`: a list of RunSummary, shown as a table."""

    def __repr__(self) -> str:
        if not self:
            return "no detached runs"
        return "\n".join(str(summary) for summary in self)


def runs() -> RunList:
    """This user's detached runs on this machine, the oldest first, with their state."""
    found = RunList()
    for directory in run_directories():
        record = directory.read()
        found.append(
            RunSummary(
                record.id,
                record.function,
                directory.state(),
                record.created,
                record.world_size,
                record.checkpoint,
            )
        )
    return found


def attach(run_id: str | None = None, wait: bool = True, live: bool | None = None) -> Any:
    """Bring a detached run (the newest, or `run_id`) into this cell.

    The cell shows what an attached launch shows: each rank's output so far and
    from then on, the progress, metrics and loss curve. With `wait` (the
    default) it returns what the launch would have returned, or raises its
    error, once the run ends; interrupting the cell leaves the run running (it
    says how to stop it). With `wait=False` it returns the `DetachedRun` at once,
    the view following the run in the background.
    """
    run = LocalRun(find_run(run_id))
    record = run.record
    view = _view(live, background=not wait)
    if not wait:
        if view is not None:
            run.follow_in_background(view)
        return run
    console = ConsoleObserver(record.output, main_rank=record.main_rank)
    run.add_observer(console)
    if view is not None:
        run.add_observer(view)
    try:
        run.wait()
    except KeyboardInterrupt:
        print(
            f"notebook_accel: stopped following run {run.id}; it goes on. "
            f'attach("{run.id}") follows it again; attach("{run.id}", wait=False).stop() '
            "stops it.",
            file=sys.stderr,
        )
        raise
    return run.result()


def _view(live: bool | None, background: bool) -> RunObserver | None:
    if live is False:
        return None
    from notebook_accel.views.live import WidgetView, live_view

    if not background:
        return live_view(force=bool(live))
    view = live_view(force=True, output="open")  # drawn from a thread: see the launcher
    if isinstance(view, WidgetView):
        view.show()
    return view
