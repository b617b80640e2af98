"""How long each teaching notebook takes top to bottom in a real kernel, against a
trivial notebook run the same way (a kernel started, one cell) in the same run.

    python bench/notebooks.py [--repeats 1]

The README says each notebook runs in under a minute on a CPU; this is where that
is measured (tests/notebooks runs them for correctness and only prints the time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def seconds_to_run(notebook: nbformat.NotebookNode) -> float:
    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": directory}},
        ).execute()
        return time.monotonic() - started


def trivial() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("import notebook_accel")]
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    options = parser.parse_args()
    rows = []
    for path in NOTEBOOKS:
        reference, taken = [], []
        for _ in range(options.repeats):  # the reference right before each, same load
            reference.append(seconds_to_run(trivial()))
            taken.append(seconds_to_run(nbformat.read(path, as_version=4)))
        rows.append((path.name, statistics.median(taken), statistics.median(reference)))
    print("| notebook | seconds | a kernel with `import notebook_accel` | ratio |")
    print("|---|---|---|---|")
    for name, seconds, reference in rows:
        print(f"| {name} | {seconds:.1f} | {reference:.1f} | {seconds / reference:.1f}x |")


if __name__ == "__main__":
    main()
