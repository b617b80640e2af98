"""The README's main job runs end to end."""

from __future__ import annotations

import subprocess
import sys


def test_demo_trains_on_two_cpu_workers_and_reports_metrics():
    done = subprocess.run(
        [sys.executable, "-m", "notebook_accel.cli", "demo", "--epochs", "2", "--cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "trained on 2 worker(s) (cpu, precision no)" in out
    assert "epoch 2/2: loss" in out and "[rank 1]" not in out  # accelerator.print: main only
    accuracy = float(out.split("accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    assert "on 4096 samples" in out  # gather_for_metrics: exactly one item per sample
