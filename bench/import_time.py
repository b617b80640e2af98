"""Import cost, net of `import torch`, each in a fresh interpreter.

Each figure is the median over several fresh interpreters. torch is imported
first and not counted, so what remains is the package's own cost:
  notebook_accel                 `import notebook_accel` (torch is not needed)
  notebook_accel.Accelerator     the first use of the Accelerator class
  accelerate                     `import accelerate` (when installed)
  accelerate.Accelerator         `from accelerate import Accelerator`

    python bench/import_time.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys

PROBE = """
import time, torch
start = time.perf_counter()
{statement}
print(time.perf_counter() - start)
"""

CASES = {
    "notebook_accel": "import notebook_accel",
    "notebook_accel.Accelerator": "import notebook_accel; notebook_accel.Accelerator",
    "accelerate": "import accelerate",
    "accelerate.Accelerator": "from accelerate import Accelerator",
}


def measure(statement: str, repeats: int) -> float:
    """Median seconds for `statement` after torch is loaded, in fresh interpreters."""
    # Bytecode caches allowed, as in an installed package; the first run writes
    # them and is not counted.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times = []
    for _ in range(repeats + 1):
        done = subprocess.run(
            [sys.executable, "-c", PROBE.format(statement=statement)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        times.append(float(done.stdout.strip().splitlines()[-1]))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    options = parser.parse_args()
    have_accelerate = importlib.util.find_spec("accelerate") is not None
    results = {
        name: measure(statement, options.repeats)
        for name, statement in CASES.items()
        if have_accelerate or not name.startswith("accelerate")
    }
    print(f"{'import (net of torch)':<30}{'ms':>8}")
    for name, seconds in results.items():
        print(f"{name:<30}{seconds * 1000:>8.1f}")
    if have_accelerate:
        ratio = results["accelerate.Accelerator"] / results["notebook_accel.Accelerator"]
        print(f"Accelerator class: {ratio:.1f}x faster to reach than Accelerate's")


if __name__ == "__main__":
    main()
