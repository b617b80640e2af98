"""Detached runs' tests: each test's runs live in a directory of its own, and after the
test no keeper of them runs on (a keeper is nobody's child: the suite's check of a test's
child processes cannot see it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from notebook_accel.launch.runs.directory import ENV_RUNS_DIR, RunDirectory


def processes_of_runs(root: Path) -> list[psutil.Process]:
    """The keepers of the runs under `root` that still run, and everything they started."""
    found = []
    for path in root.iterdir():
        keeper = RunDirectory(path).keeper() if (path / "run.json").exists() else None
        if keeper is not None:
            found.append(keeper)
            try:
                found += keeper.children(recursive=True)
            except psutil.Error:
                pass
    return found


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """Where this test's detached runs live ($NOTEBOOK_ACCEL_RUNS_DIR; kernels started by
    the test inherit it). A keeper still running at the end fails the test, after it and
    its workers are killed."""
    root = tmp_path / "runs"
    monkeypatch.setenv(ENV_RUNS_DIR, str(root))
    yield root
    if not root.exists():
        return
    deadline = time.monotonic() + 5  # a run stopped just now is still tearing down
    while (left := processes_of_runs(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    assert not left, f"processes of detached runs left: {[(p.pid, p.name()) for p in left]}"
