"""Run Accelerate's own unit tests of its core API against notebook_accel, by hand.

Accelerate keeps its unit tests in its source repository, not in its wheel, so this
is a tool to run with a copy of them (a checkout of huggingface/accelerate), like
accelerate_big_model_tests.py:

    python tests/compat/accelerate_unit_tests.py ACCELERATE_CHECKOUT --cpu
    python tests/compat/accelerate_unit_tests.py path/to/test_accelerator.py ...

Each file is run twice with pytest, each time in a fresh interpreter: as it is (under
Accelerate), and with every name it imports from `accelerate.X` that notebook_accel
has imported from notebook_accel instead: from `notebook_accel.X` (the one-line port a
user makes) where that module has the name, else from `notebook_accel.utils` (names
of `accelerate.utils.*` submodules) or `notebook_accel`, or for big-model names
(`accelerate.hooks`, `accelerate.utils.modeling`) `notebook_accel.big_modeling`.
Nothing else changes and line numbers stay. Names we do not have, and Accelerate's test fixtures
(`accelerate.test_utils`), keep coming from Accelerate.

Accelerate's `AccelerateTestCase` resets Accelerate's shared state after each test;
the ported run resets notebook_accel's too, through a conftest.py beside the files.

The tests see the machine's accelerators; `--cpu` hides the GPUs from both runs. The
files need `parameterized` (a dev dependency), transformers and torchdata.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import accelerate_test_files  # noqa: E402

TEST_FILES = (
    "test_accelerator.py",
    "test_state_checkpointing.py",
    "test_data_loader.py",
    "test_kwargs_handlers.py",
    "test_optimizer.py",
    "test_tracking.py",
    "test_memory_utils.py",
    "test_utils.py",
    "test_logging.py",
    "test_scheduler.py",
)

# What AccelerateTestCase.tearDown does for Accelerate, done for notebook_accel.
CONFTEST = """
import pytest


@pytest.fixture(autouse=True)
def _reset_notebook_accel_state():
    yield
    from notebook_accel.state import AcceleratorState

    AcceleratorState._reset_state(True)
"""


def _has(module: str, name: str) -> bool:
    try:
        found = importlib.import_module(module)
    except ImportError:
        return False
    return hasattr(found, name)


def resolve(module: str, name: str) -> str | None:
    """The notebook_accel module to import `name` from, in place of `module`."""
    same_path = "notebook_accel" + module.removeprefix("accelerate")
    candidates = [same_path]
    if module.startswith("accelerate.utils."):
        candidates.append("notebook_accel.utils")
    candidates += ["notebook_accel", "notebook_accel.utils"]
    if module.startswith(("accelerate.hooks", "accelerate.big_modeling", "accelerate.utils")):
        candidates.append("notebook_accel.big_modeling")  # where big-model names live
    return next((c for c in candidates if _has(c, name)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="an Accelerate checkout, or the test files")
    parser.add_argument("--cpu", action="store_true", help="hide GPUs from both runs")
    options = parser.parse_args()
    files = accelerate_test_files.find_test_files(options.paths, TEST_FILES)
    results = accelerate_test_files.run_both_ways(files, resolve, options.cpu, CONFTEST)
    accelerate_test_files.print_comparison(results)


if __name__ == "__main__":
    main()
