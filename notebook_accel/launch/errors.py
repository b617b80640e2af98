"""The exception a failed launch raises in the kernel."""

from __future__ import annotations

import signal
from dataclasses import dataclass

# Code written for Accelerate catches torch's ChildFailedError from a failed
# launch, so WorkerError is one. Importing it costs about 10 ms once torch is
# loaded, and everything that raises WorkerError has loaded torch already.
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker ended badly: an exception, a non-zero exit or a signal."""

    rank: int
    exitcode: int | None
    traceback: str = ""
    exception: str = ""
    # Where it ran ("node 10.0.0.7 (3f2a9c01)"), when not on this machine.
    where: str = ""
    # Why it could no longer be reached (its node left the cluster), if it could not.
    lost: str = ""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def how(self) -> str:
        """How it ended: "raised ...", "was killed by SIGKILL", "exited with code 1", ..."""
        if self.lost:
            return f"was lost: {self.lost}"
        if self.exception:
            return f"raised {self.exception.splitlines()[0]}"
        if self.signal_name:
            return f"was killed by {self.signal_name}"
        if self.exitcode is None:
            return "stopped responding"
        return f"exited with code {self.exitcode}"

    def describe(self) -> str:
        who = f"worker rank {self.rank}" + (f" on {self.where}" if self.where else "")
        return f"{who} {self.how}"


class WorkerError(RuntimeError, ChildFailedError):
    """A worker raised, exited non-zero or was killed; the others were stopped.

    `rank`, `exitcode` and `traceback` describe the first failure (the cause);
    `failures` lists every worker that ended badly, the cause first. `ending`
    says what became of the workers (live workers may still be running).

    It is also torch's `ChildFailedError` (what Accelerate's launcher raises),
    so `except ChildFailedError` catches it; `get_first_failure()` gives the
    cause's rank and `WorkerFailure`, and the message is this one's.
    """

    name = "notebook_launcher"  # ChildFailedError's name of what failed

    def __init__(
        self, failures: list[WorkerFailure], ending: str = "the other workers were stopped."
    ):
        if not failures:
            raise ValueError("WorkerError needs at least one failure")
        self.failures = list(failures)
        self.ending = ending
        first = self.failures[0]
        self.rank = first.rank
        self.exitcode = first.exitcode
        self.traceback = first.traceback
        lines = [f"{first.describe()}; {ending}"]
        if first.traceback:
            lines += ["", f"Traceback from rank {first.rank}:", first.traceback.rstrip()]
        if len(self.failures) > 1:
            others = ", ".join(f.describe() for f in self.failures[1:])
            lines += ["", f"Also ended: {others} (most likely a consequence)."]
        super().__init__("\n".join(lines))

    def get_first_failure(self) -> tuple[int, WorkerFailure]:
        """The rank and the failure that caused the others (ChildFailedError's API)."""
        return self.rank, self.failures[0]

    def format_msg(self, *args: object, **kwargs: object) -> str:
        """The message (ChildFailedError's API)."""
        return str(self)

    def __reduce__(self):
        return (type(self), (self.failures, self.ending))


class PlacementError(RuntimeError):
    """The workers cannot be placed: the cluster lacks what the launch asks for (or
    cannot be reached). Raised before any worker starts; the message says what was
    asked, what there is, and what to do."""
