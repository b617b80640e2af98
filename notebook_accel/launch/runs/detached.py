"""A detached run seen from a kernel: follow it, stop it, get its result.

`DetachedRun` replays the events its keeper logged into a report of its own,
the same `RunReport` a launch fills, then follows them as the keeper goes on.
Any kernel of the user can do this, any number of times: the run does not
know who watches.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from notebook_accel.launch.runs.directory import RunRecord
from notebook_accel.reporting.events import RunEnded
from notebook_accel.reporting.observers import RunFeed, RunObserver
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
    raises the run's error: the `WorkerError` (with the rank's traceback), a
    `TimeoutError`, `KeyboardInterrupt` for a run that was stopped, or
    `RunLostError` for one whose keeper died before the end. `stop()` stops
    it, from any kernel.
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
            checkpoint=record.checkpoint,
        )
        self._feed = RunFeed(self.report)
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
        return "lost" if self.keeper_gone() else self.record.state

    def __repr__(self) -> str:
        return f"<DetachedRun {self.id}: {self.record.function}, {self.state}>"

    def poll(self) -> bool:
        """Take in what the run did since the last call; True once it has ended."""
        with self._lock:
            if self._ended.is_set() or self._take_new():
                return True
            now = time.monotonic()
            if now - self._keeper_checked < KEEPER_CHECK_SECONDS:
                return False
            self._keeper_checked = now
            if not self.keeper_gone():
                return False
            if self._take_new():  # what the keeper logged before it went
                return True
            self._take(RunEnded(RunLostError(self.id, self.report.checkpoint, self.on_lost())))
            return True

    def _take_new(self) -> bool:
        for _, event in self.read_new():  # the run's end comes last
            self._take(event)
        return self._ended.is_set()

    def _take(self, event: Any) -> None:
        self._feed(event)
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
        first, results = self.record.main_rank, self.report.results
        if self.record.return_all:
            return [
                results.get(rank) for rank in range(first, first + self.record.local_world_size)
            ]
        return results.get(first)

    def add_observer(self, observer: RunObserver) -> None:
        """Hand `observer` every event from now on, as whoever follows the run reads it
        (the events so far, if nobody has read them yet)."""
        self._feed.observers.append(observer)

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
        return "\n".join(
            line.text
            if rank is not None or line.rank is None
            else rank_prefix(line.rank, self.report.main_rank) + line.text
            for line in self.report.output(rank=rank)
        )

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the run from this kernel (it needs nothing else: any kernel of the user
        can): every worker is stopped, the run ends "stopped" and its keeper exits.
        Waits at most `timeout` s for that; a run that has ended already is left as it is."""
        deadline = time.monotonic() + timeout
        if self.poll() or not self.ask_to_stop():
            return
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.id} did not stop within {timeout} s")
        self.after_stop(max(0.0, deadline - time.monotonic()))

    def resume(self) -> DetachedRun:
        """Start this run's function again, detached, from the newest checkpoint it saved:
        in the workers, `resume_checkpoint()` gives that directory (for
        `accelerator.load_state`). For a run that ended without finishing."""
        self.poll()
        state = self.state
        if state == "finished":
            raise RuntimeError(f"run {self.id} finished: there is nothing to resume")
        if state in ("starting", "running"):
            raise RuntimeError(
                f"run {self.id} is {state}: only a run that was lost, failed or stopped is "
                "resumed (stop() it first to start over from its checkpoint)"
            )
        plan = self.shipped_plan()
        plan = dataclasses.replace(plan, resume_from=self.report.checkpoint or plan.resume_from)
        return self.start(plan, resumed_from=self.id)

    # -- what each place of keepers provides (local.py, on_cluster.py) ------------

    def read_new(self) -> list[tuple[int, Any]]:
        """The events the keeper logged since the last call."""
        raise NotImplementedError

    def keeper_gone(self) -> bool:
        """Whether the keeper no longer runs (it can log nothing more); brings `record`
        up to date while it does."""
        raise NotImplementedError

    def on_lost(self) -> str:
        """Record the loss where the run is kept; return why it was lost, if known."""
        return ""

    def ask_to_stop(self) -> bool:
        """Tell the keeper to stop the run; False if it is gone already."""
        raise NotImplementedError

    def after_stop(self, seconds: float) -> None:
        """Wait at most `seconds` for the keeper to be gone once the run ended stopped."""

    @classmethod
    def start(cls, plan: Any, resumed_from: str | None = None) -> DetachedRun:
        """Start a checked launch plan under a keeper of this place; return its handle at
        once. `resumed_from`: the run it goes on from (at `plan.resume_from`, its checkpoint)."""
        raise NotImplementedError

    def shipped_plan(self) -> Any:
        """The launch as it was shipped to the keeper (for `resume`)."""
        raise NotImplementedError

    def forget(self) -> None:
        """Remove what is kept of this run (its outcome, output and events): it is no
        longer listed by `runs()` nor found by `attach()`."""
        raise NotImplementedError
