"""Where a run's output and events go in the launching process.

The worker group reports to an observer; the default one prints to this
process's stdout and stderr (the running cell, in a notebook). Other views,
such as a live progress display or the control panel, are observers too.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

OUTPUT_CHOICES = ("all", "main", "none")


def rank_prefix(rank: int, main_rank: int) -> str:
    """What goes before a worker's output line: nothing for the main rank."""
    return "" if rank == main_rank else f"[rank {rank}] "


class RunObserver:
    """Receives a run's events. Every method is optional."""

    def on_start(self, workers: int, attempt: int) -> None:
        """An attempt starts `workers` processes on this machine (attempt 0, then restarts)."""

    def on_output(self, rank: int, stream: str, line: str) -> None: ...

    def on_message(self, rank: int, kind: str, payload: Any) -> None: ...

    def on_worker_exit(self, rank: int, exitcode: int) -> None: ...

    def on_restart(self, attempt: int, error: BaseException) -> None: ...

    def on_end(self, error: BaseException | None) -> None: ...


class ConsoleObserver(RunObserver):
    """Writes worker output to sys.stdout/sys.stderr, other ranks prefixed."""

    def __init__(self, output: str = "all", main_rank: int = 0):
        self.output = output
        self.main_rank = main_rank

    def on_output(self, rank: int, stream: str, line: str) -> None:
        if self.output == "none" or (self.output == "main" and rank != self.main_rank):
            return
        target = sys.stderr if stream == "stderr" else sys.stdout
        target.write(rank_prefix(rank, self.main_rank) + line)
        target.flush()

    def on_restart(self, attempt: int, error: BaseException) -> None:
        # The cause first (which rank, and how it ended), then what happens next.
        failures = getattr(error, "failures", None)
        cause = failures[0].describe() if failures else str(error).splitlines()[0]
        sys.stderr.write(
            f"notebook_accel: {cause}; restarting every worker (restart {attempt}); "
            "a function that calls load_state() continues from its newest checkpoint\n"
        )
        sys.stderr.flush()


class ObserverGroup(RunObserver):
    """Forwards every event to several observers, in order."""

    def __init__(self, observers: list[RunObserver]):
        self.observers = observers

    def on_start(self, workers: int, attempt: int) -> None:
        for observer in self.observers:
            observer.on_start(workers, attempt)

    def on_output(self, rank: int, stream: str, line: str) -> None:
        for observer in self.observers:
            observer.on_output(rank, stream, line)

    def on_message(self, rank: int, kind: str, payload: Any) -> None:
        for observer in self.observers:
            observer.on_message(rank, kind, payload)

    def on_worker_exit(self, rank: int, exitcode: int) -> None:
        for observer in self.observers:
            observer.on_worker_exit(rank, exitcode)

    def on_restart(self, attempt: int, error: BaseException) -> None:
        for observer in self.observers:
            observer.on_restart(attempt, error)

    def on_end(self, error: BaseException | None) -> None:
        # Every view gets the end, and a view that fails drawing it must not
        # replace the run's own error on its way to the caller.
        for observer in self.observers:
            try:
                observer.on_end(error)
            except Exception as failure:  # noqa: BLE001
                warnings.warn(
                    f"{type(observer).__name__} could not show the end of the run: {failure!r}",
                    stacklevel=2,
                )


class LineBuffer:
    """Joins chunks of a stream into whole lines."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [line.decode(errors="replace") + "\n" for line in lines]

    def flush(self) -> list[str]:
        rest, self._pending = self._pending, b""
        return [rest.decode(errors="replace") + "\n"] if rest else []
