"""The package's first import is safe from any number of threads (tests/import_race.py):
a kernel's background thread and a cell may import it, or its modules, at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.timeout(600)
def test_thirty_threads_import_the_package_and_its_modules_at_once_fifty_times():
    done = subprocess.run(
        [sys.executable, str(HERE / "import_race.py"), "50", "30"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["rounds"] == 50
    assert found["modules"] > 100  # every module that imports here, not a handful
    assert found["errors"] == [], "\n".join(found["errors"][:5])
