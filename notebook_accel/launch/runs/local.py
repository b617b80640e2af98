"""A detached run whose keeper is a process of this machine: start it, follow it.

The keeper (keeper.py, started by starting.py) logs the run's events into its
run directory (directory.py, log.py); `LocalRun` reads them from there.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from typing import Any

import psutil

from notebook_accel.launch.runs.detached import DetachedRun
from notebook_accel.launch.runs.directory import RunDirectory
from notebook_accel.launch.runs.log import EventLogReader
from notebook_accel.launch.runs.starting import read_plan, start_keeper, write_plan
from notebook_accel.reporting.events import RunEnded

# How long forget() waits for an ended run's keeper to exit.
EXIT_SECONDS = 30.0


class LocalRun(DetachedRun):
    """A detached run whose keeper is a process of this machine (runs/keeper.py); its
    events, record and shipped launch are in its run directory (`directory`)."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory
        super().__init__(directory.read())
        self._reader = EventLogReader(directory.path)

    def read_new(self) -> list[tuple[int, Any]]:
        found = self._reader.read_available()
        if any(isinstance(event, RunEnded) for _, event in found):
            self._reader.close()
        return found

    def keeper_gone(self) -> bool:
        return self.directory.state() == "lost"

    def on_lost(self) -> str:
        # The keeper can no longer write the record: the first to see the loss does.
        self.record = self.directory.update(state="lost", ended=time.time())
        return self.directory.keeper_log_tail(1)

    def state_now(self) -> str:
        return self.directory.state()

    def ask_to_stop(self) -> bool:
        self._keeper = self.directory.keeper()
        if self._keeper is None:
            return False
        with contextlib.suppress(psutil.NoSuchProcess):
            self._keeper.send_signal(signal.SIGINT)
        return True

    def after_stop(self, seconds: float) -> None:
        try:
            self._keeper.wait(seconds)
        except psutil.TimeoutExpired:
            raise TimeoutError(f"run {self.id}'s keeper did not exit within its stop") from None
        except psutil.NoSuchProcess:
            pass

    def forget(self) -> None:
        """Remove the run's directory; refused while the run goes (stop it first)."""
        keeper = self.directory.keeper()
        if keeper is not None:
            if not self.directory.read().ended_state:
                raise RuntimeError(f"run {self.id} is still {self.state}: stop() it first")
            with contextlib.suppress(psutil.Error):  # an ended run's keeper is exiting
                keeper.wait(EXIT_SECONDS)
        self._reader.close()
        shutil.rmtree(self.directory.path)

    def shipped_plan(self) -> Any:
        return read_plan(self.directory)

    @classmethod
    def start(cls, plan: Any, resumed_from: str | None = None) -> LocalRun:
        directory = RunDirectory.create(plan, resumed_from=resumed_from)
        write_plan(directory, plan)
        start_keeper(directory)
        return cls(directory)
