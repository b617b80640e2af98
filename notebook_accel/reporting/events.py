"""What happens during a run, as small typed events.

Workers send some of them down their channel (metric records, progress, peak
memory, their result or error); the supervisor in the launching process adds
the rest (output lines, memory samples, exits) and the launcher marks the
run's start, restarts and end. Every event goes through one reducer,
`RunReport.apply` (reporting/report.py), and then to the observers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MetricRecord:
    """One `log()` call: the values one rank reported at one step."""

    step: int | None
    rank: int
    values: dict[str, float | str]
    time: float


@dataclass(frozen=True)
class Progress:
    """A progress bar's position in one rank (the main one, unless asked otherwise)."""

    rank: int
    step: int
    total: int | None
    elapsed: float


@dataclass(frozen=True)
class ResourceSample:
    """A worker's resident memory, sampled by the supervisor about once a second."""

    rank: int
    rss_bytes: int


@dataclass(frozen=True)
class PeakResources:
    """A worker's own peak figures, sent once when its function returns or raises."""

    rank: int
    peak_rss_bytes: int
    peak_gpu_bytes: int | None = None


@dataclass(frozen=True)
class ModulesImported:
    """Modules a worker imported that were not imported when it was forked, in import
    order, each with its file (None for built-in ones); sent at the training function's
    milestones and at the worker's end, each time what is new since the last."""

    rank: int
    modules: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class Result:
    """A worker's return value, tensors moved to the CPU."""

    rank: int
    value: Any


@dataclass(frozen=True)
class WorkerRaised:
    """A worker's exception: its one-line text and its traceback from the user's function."""

    rank: int
    exception: str
    traceback: str
    time: float
    # The worker opens a post-mortem debugger now (launch option post_mortem): it
    # ends once the debugger does, and the launcher stops the others meanwhile.
    post_mortem: bool = False


@dataclass(frozen=True)
class CheckpointSaved:
    """The main worker's `save_state` wrote a complete checkpoint at `path`: a run that
    is lost can go on from the newest (launch/runs)."""

    rank: int
    path: str
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class InputRequested:
    """A worker reads its stdin (`input()`, a debugger's prompt): the launching process
    asks in the cell and writes the answer back down the channel (launch/debugging.py).
    The prompt is what the worker last wrote to stdout without a newline."""

    rank: int


@dataclass
class CallFinished:
    """A live worker finished a call (notebook_accel/live): its value, or its error.

    `call_id` 0 is the worker saying it has joined the group and waits for calls.
    """

    rank: int
    call_id: int
    value: Any = None
    error: str = ""  # "ZeroDivisionError: division by zero"; empty when it returned
    traceback: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Unreadable:
    """Bytes from a worker that the launching process could not unpickle."""

    rank: int
    reason: str


@dataclass(frozen=True)
class OutputLine:
    """One whole line a worker wrote to its stdout or stderr (newline included)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    line: str


@dataclass(frozen=True)
class WorkerExited:
    """A worker process ended, with its exit code (negative: the signal that ended it)."""

    rank: int
    exitcode: int | None


@dataclass(frozen=True)
class AttemptStarted:
    """An attempt starts `workers` processes on this machine (attempt 0, then restarts)."""

    workers: int
    attempt: int


@dataclass(frozen=True)
class Restarting:
    """Every worker is restarted after `error`; `attempt` is the restart's number (1, 2, ...)."""

    attempt: int
    error: BaseException


@dataclass(frozen=True)
class RanksStuck:
    """The workers made no progress for a while (or were stopped while stuck): where each
    rank is, its collective and its Python stack, as text for the cell."""

    text: str


@dataclass(frozen=True)
class RunEnded:
    """The run is over: `error` is None when it finished, else what the caller receives."""

    error: BaseException | None
    time: float = field(default_factory=time.time)


# Events a worker sends down its channel.
ChannelEvent = (
    MetricRecord
    | Progress
    | PeakResources
    | ModulesImported
    | Result
    | WorkerRaised
    | CallFinished
    | InputRequested
    | CheckpointSaved
)
RunEvent = (
    ChannelEvent
    | ResourceSample
    | Unreadable
    | OutputLine
    | WorkerExited
    | AttemptStarted
    | Restarting
    | RanksStuck
    | RunEnded
)
