"""What the GPU tests share: the skip without a GPU, and running a prepared scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

needs_a_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU and a CUDA build of torch; run `python -m pytest tests/gpu` there",
)


def run_scenario(name: str, timeout: float) -> dict:
    """Run tests/gpu/`name` in its own process (CUDA starts untouched there) and
    return the JSON it printed after "RESULTS "."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "gpu" / name)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])
