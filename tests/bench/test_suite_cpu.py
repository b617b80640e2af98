"""bench/suite_cpu.py: the command's processes by kind, forks apart, nobody else's."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests_support import PROMPTLY

SCRIPT = Path(__file__).parents[2] / "bench" / "suite_cpu.py"

# Spins about a CPU-second in this process, in a fork of it and in a new interpreter
# started in a session of its own (as a keeper is), then exits with 3.
COMMAND = textwrap.dedent(
    """
    import os, subprocess, sys, time

    def spin(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    child = os.fork()
    if child == 0:
        spin(1.0)
        os._exit(0)
    apart = subprocess.Popen(
        [sys.executable, "-u", "-c", "import time\\nend = time.process_time() + 1\\n"
         "while time.process_time() < end: pass"], start_new_session=True)
    spin(1.0)
    os.waitpid(child, 0)
    apart.wait()
    sys.exit(3)
    """
)


def rows(output: str) -> dict[str, tuple[float, int]]:
    found = {}
    for line in output.splitlines():
        match = re.match(r"\s*([\d.]+)\s+(\d+)\s+(.+)$", line)
        if match:
            found[match[3]] = (float(match[1]), int(match[2]))
    return found


def test_each_kind_s_cpu_the_forks_apart_and_the_command_s_exit_status():
    # Beside the command, a spinning process of the test's: not the command's.
    outsider = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"])
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--every", "0.1", "--", sys.executable, "-c", COMMAND],
            capture_output=True,
            text=True,
            timeout=PROMPTLY,
        )
    finally:
        outsider.kill()
        outsider.wait()
    assert done.returncode == 3, done.stderr
    table = rows(done.stdout)
    command, forked = table["other: python -c"], table["other: python -c, forked"]
    assert forked[1] == 1 and forked[0] > 0.5, done.stdout
    assert command[1] == 1 and command[0] > 0.5, done.stdout
    assert table["other: python -u"][0] > 0.5, done.stdout  # in a session of its own
    assert not any("-S" in kind for kind in table), done.stdout
    assert "CPU-seconds in 3 processes of the command" in done.stdout
