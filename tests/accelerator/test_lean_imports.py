"""A worker's first Accelerator() imports only what every run needs: what only some
runs use (checkpoints, profiling, peft adapters) comes on first use. Each forked
worker pays for what it imports in every launch that warming does not cover
(warm=False, a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

ONLY_ON_USE = (
    "notebook_accel.checkpoint.training_state",
    "notebook_accel.checkpoint.checksums",
    "notebook_accel.accelerator.profiling",
    "notebook_accel.training.adapters",
    "safetensors",
)

PROBE = """
import json, sys
from notebook_accel import notebook_launcher  # what a kernel has before its first launch
from notebook_accel import Accelerator
accelerator = Accelerator(cpu=True)
first = set(sys.modules)
accelerator.save_state(sys.argv[1])
print(json.dumps({"first": sorted(first), "after_save": sorted(set(sys.modules) - first)}))
"""


def test_the_first_accelerator_leaves_checkpoints_profiling_and_adapters_for_later(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert [name for name in ONLY_ON_USE if name in seen["first"]] == []
    assert "notebook_accel.checkpoint.training_state" in seen["after_save"]
