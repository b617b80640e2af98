"""Accelerate's own tests of `ParallelismConfig` (the class TestParallelismConfig of its
tests/test_dataclasses.py, from the accelerate sdist) pass here with their imports
pointed at notebook_accel, test for test as under Accelerate
(accelerate_parallelism_tests.py runs them both ways)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from tests_support import dev_dependency  # noqa: E402

dev_dependency("accelerate")

import accelerate_parallelism_tests  # noqa: E402
import venv_cache  # noqa: E402


@pytest.fixture(scope="module")
def test_file() -> Path:
    version = accelerate_parallelism_tests.SDIST_VERSION
    assert metadata.version("accelerate") == version, "the sdist pinned is the dev dependency's"
    try:
        return accelerate_parallelism_tests.sdist_test_file()
    except accelerate_parallelism_tests.SdistUnavailable as error:
        if venv_cache.pip_finds("accelerate", version):
            raise  # pip lists it, so the download failing is a real failure
        pytest.skip(f"pip finds no accelerate {version} sdist here ({error})")


@pytest.mark.timeout(300)
def test_accelerate_s_parallelism_config_tests_pass_as_under_accelerate(test_file):
    results = accelerate_parallelism_tests.run([test_file], hide_gpus=True)
    theirs, ours = results["accelerate"], results["notebook_accel"]
    passing = sorted(name for name, verdict in theirs.items() if verdict == "passed")
    assert len(passing) == 32  # the pinned file's count under Accelerate on this machine
    differ = {name: (theirs.get(name), ours.get(name)) for name in theirs.keys() | ours.keys()}
    assert {name: pair for name, pair in differ.items() if pair[0] != pair[1]} == {}
