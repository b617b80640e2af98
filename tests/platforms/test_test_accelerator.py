"""The test accelerator's own checks (tests/testaccel/device_checks.py), in a pytest
process of their own: importing the device would make it the accelerator of every
later test here (so tests/conftest.py keeps pytest out of tests/testaccel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / "testaccel"


@pytest.mark.timeout(300)
def test_the_test_accelerator_passes_its_own_checks():
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "device_checks.py"),
        ],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=280,
        cwd=HERE.parent.parent,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
