"""Run Accelerate's own big-model tests against notebook_accel.big_modeling, by hand.

Accelerate keeps `tests/test_big_modeling.py` and `tests/test_modeling_utils.py` in its
source repository (not in its wheel), so this is a tool to run with a copy of them, not
part of the suite:

    python tests/compat/accelerate_big_model_tests.py ACCELERATE_CHECKOUT
    python tests/compat/accelerate_big_model_tests.py test_big_modeling.py test_modeling_utils.py

Each file is run twice with pytest, each time in a fresh interpreter: as it is (under
Accelerate), and with every name it imports from `accelerate...` that
`notebook_accel.big_modeling` provides imported from there instead (the one-line port a
user makes); nothing else changes, and the line numbers stay the same. Names we do not
provide (Accelerate's test decorators, `torch_device`) keep coming from Accelerate.
It prints the counts under each library and every test whose outcome differs.

The tests see the machine's accelerators; `--cpu` hides the GPUs from both runs. The
test files need `parameterized` (a dev dependency) and transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import accelerate_test_files  # noqa: E402

TEST_FILES = ("test_big_modeling.py", "test_modeling_utils.py")
OURS = "notebook_accel.big_modeling"


def resolver():
    """Names notebook_accel.big_modeling has come from there, whatever module they were in."""
    ours = set(importlib.import_module(OURS).__all__)
    return lambda module, name: OURS if name in ours else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="an Accelerate checkout, or the test files")
    parser.add_argument("--cpu", action="store_true", help="hide GPUs from both runs")
    options = parser.parse_args()
    files = accelerate_test_files.find_test_files(options.paths, TEST_FILES)
    results = accelerate_test_files.run_both_ways(files, resolver(), options.cpu)
    accelerate_test_files.print_comparison(results)


if __name__ == "__main__":
    main()
