"""A forked worker leaves what it inherited from the launching process alone: it never runs
the destructors of that process's garbage (a Ray connection left behind by a cell crashed
workers that collected it) nor its signal handlers (Ray's SIGTERM handler stops the
cluster of the process that started it)."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from notebook_accel import notebook_launcher


class WritesItsDeath:
    """Garbage in a reference cycle, so that only the collector frees it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cycle = self

    def __del__(self) -> None:
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")


def collects_garbage():
    gc.collect()
    return os.getpid()


def test_a_worker_never_destroys_the_garbage_it_inherited(tmp_path):
    marker = tmp_path / "destroyed"
    gc.disable()  # the cycle stays uncollected here until the launch is over
    try:
        WritesItsDeath(str(marker))
        workers = notebook_launcher(
            collects_garbage, num_processes=2, backend="cpu", return_all=True, live=False
        )
    finally:
        gc.enable()
    assert not marker.exists(), f"destroyed in a worker: {marker.read_text().split()}"
    gc.collect()
    assert marker.read_text().split() == [str(os.getpid())]  # here, where it was made
    assert os.getpid() not in workers


def test_the_launching_process_s_own_frozen_objects_stay_frozen(tmp_path):
    assert gc.get_freeze_count() == 0
    notebook_launcher(collects_garbage, num_processes=2, backend="cpu", live=False)
    assert gc.get_freeze_count() == 0  # what the launch froze, it unfroze
    marker = tmp_path / "destroyed"
    WritesItsDeath(str(marker))
    gc.freeze()  # as a server that forks its own workers does
    try:
        notebook_launcher(collects_garbage, num_processes=2, backend="cpu", live=False)
        gc.collect()
        assert not marker.exists()  # still frozen: the launch did not unfreeze it
    finally:
        gc.unfreeze()
    gc.collect()
    assert marker.read_text().split() == [str(os.getpid())]


def sleeps():
    time.sleep(600)


def test_a_stopped_worker_never_runs_the_launching_process_s_sigterm_handler(tmp_path):
    marker = tmp_path / "handled"

    def launching_process_s_handler(signum, frame):
        marker.write_text(str(os.getpid()))
        os._exit(0)

    previous = signal.signal(signal.SIGTERM, launching_process_s_handler)
    try:
        with pytest.raises(TimeoutError):
            notebook_launcher(sleeps, num_processes=2, backend="cpu", timeout=3, live=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not marker.exists(), f"ran in worker {marker.read_text()}"
