"""A detached run whose keeper is a process of this machine: start it, follow it.

The keeper (keeper.py) is nobody's child (processes.start_detached): the kernel
does not wait for it, and a kernel that dies or restarts does not take it along.
It logs the run's events into the run directory (log.py); `LocalRun` reads them
from there.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import psutil

from notebook_accel.launch.processes import start_detached
from notebook_accel.launch.runs.detached import DetachedRun
from notebook_accel.launch.runs.directory import KEEPER_LOG, RunDirectory, open_private
from notebook_accel.launch.runs.log import EventLogReader
from notebook_accel.reporting.events import RunEnded

# How long forget() waits for an ended run's keeper to exit.
EXIT_SECONDS = 30.0
# How long the kernel waits for the keeper's first process to hand over (it only forks).
HANDOVER_SECONDS = 60.0


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
        self.record = self.directory.read()
        return self.directory.state(self.record) == "lost"

    def on_lost(self) -> str:
        # The keeper can no longer write the record: the first to see the loss does.
        self.record = self.directory.update(state="lost", ended=time.time())
        return self.directory.keeper_log_tail(1)

    def ask_to_stop(self) -> bool:
        self._keeper = self.directory.keeper()
        if self._keeper is None:
            return False
        self._keeper.kill(signal.SIGINT)
        return True

    def after_stop(self, seconds: float) -> None:
        self._keeper.join(seconds)
        if self._keeper.exitcode is None:
            raise TimeoutError(f"run {self.id}'s keeper did not exit within its stop")

    def forget(self) -> None:
        """Remove the run's directory; refused while the run goes (stop it first)."""
        keeper = self.directory.keeper()
        if keeper is not None:
            if not self.directory.read().ended_state:
                raise RuntimeError(f"run {self.id} is still {self.state}: stop() it first")
            keeper.join(EXIT_SECONDS)  # an ended run's keeper is exiting
        self._reader.close()
        shutil.rmtree(self.directory.path)

    def shipped_plan(self) -> Any:
        return self.directory.read_plan()

    @classmethod
    def start(cls, plan: Any, resumed_from: str | None = None) -> LocalRun:
        """Start the run's keeper and return at once, before it imports torch: the run
        starts while the kernel goes on. Raises RuntimeError, with the keeper's words, if
        it could not start."""
        directory = RunDirectory.create(plan, resumed_from=resumed_from)
        with os.fdopen(open_private(directory.path / KEEPER_LOG, append=True), "ab") as log:
            keeper = "notebook_accel.launch.runs.keeper:keeper_main"
            pid = start_detached(keeper, [str(directory.path)], log, HANDOVER_SECONDS)
        if pid is None:
            directory.update(state="lost", error="the keeper did not start")
            raise RuntimeError(
                "the detached run's keeper process did not start:\n" + directory.keeper_log_tail()
            )
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:  # it ended already: its log says why
            started = None
        directory.update(keeper_pid=pid, keeper_started=started)
        return cls(directory)
