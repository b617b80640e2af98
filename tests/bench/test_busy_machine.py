"""bench/busy_machine.py: it lists what the command left running, and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests_support import PROMPTLY

SCRIPT = Path(__file__).parents[2] / "bench" / "busy_machine.py"

# Leaves two sleepers, a child and an orphan (its parent exits), then waits for the
# test to start a process of its own beside it.
LEAVES_TWO = textwrap.dedent(
    """
    import os, pathlib, subprocess, sys, time
    sleep = "import time; time.sleep(60)  # "
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # the pipe may end
    subprocess.Popen([sys.executable, "-c", sleep + "child"], **quiet)
    if os.fork() == 0:
        subprocess.Popen([sys.executable, "-c", sleep + "orphan"], **quiet)
        os._exit(0)
    os.wait()
    flags = pathlib.Path(sys.argv[1])
    (flags / "started").touch()
    deadline = time.monotonic() + 60
    while not (flags / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def _sleepers(output: str) -> list[int]:
    """The listed processes that are this test's sleepers (each listed "PID command")."""
    return [int(pid) for pid in re.findall(r"^\s+(\d+) .*time\.sleep\(60\)", output, re.M)]


@pytest.mark.timeout(120)
def test_what_the_command_left_is_listed_and_what_ran_beside_it_is_not(tmp_path):
    run = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--busy", "1", "--no-ray", "--"]
        + [sys.executable, "-c", LEAVES_TWO, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    beside = None
    try:
        deadline = time.monotonic() + PROMPTLY
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # Started while the command runs, but by this test: not the command's.
        beside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # beside"])
        (tmp_path / "go").touch()
        output, _ = run.communicate(timeout=PROMPTLY)
    finally:
        run.kill()
        for process in [beside] if beside else []:
            process.kill()
            process.wait()
    left = _sleepers(output)
    try:
        assert run.returncode == 3, output
        assert "# child" in output and "# orphan" in output, output
        assert "# beside" not in output
    finally:
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.timeout(120)
def test_a_command_that_leaves_nothing_passes_with_its_own_status():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--busy", "1", "--no-ray", "--"]
        + [sys.executable, "-c", "import sys; sys.exit(7)"],
        capture_output=True,
        text=True,
        timeout=PROMPTLY,
    )
    assert done.returncode == 7, done.stdout + done.stderr
    assert "it left no process running" in done.stdout
