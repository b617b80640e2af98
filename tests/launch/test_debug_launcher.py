"""debug_launcher: Accelerate's CPU launcher for testing distributed code, on CPU workers."""

from __future__ import annotations

import pytest
import torch

from notebook_accel import Accelerator, WorkerError, debug_launcher


def _who(scale):
    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor(float(accelerator.process_index + 1)) * scale)
    return {
        "world": accelerator.num_processes,
        "device": str(accelerator.device),
        "precision": accelerator.mixed_precision,
        "distributed": str(accelerator.distributed_type),
        "total": float(total),
    }


def test_two_cpu_workers_form_a_group_and_the_main_ones_value_comes_back(monkeypatch):
    # Mixed precision asked for by the environment does not reach the debug run.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    result = debug_launcher(_who, args=(2.0,))
    assert result == {
        "world": 2,
        "device": "cpu",
        "precision": "no",
        "distributed": "MULTI_CPU",
        "total": 6.0,
    }


def test_a_failing_worker_is_a_worker_error_naming_its_rank():
    def fails():
        if Accelerator().process_index == 1:
            raise ValueError("rank one broke")

    with pytest.raises(WorkerError, match="rank one broke") as raised:
        debug_launcher(fails, num_processes=2)
    assert raised.value.rank == 1


def test_it_runs_cpu_workers_only():
    with pytest.raises(TypeError, match="takes no backend="):
        debug_launcher(_who, args=(1.0,), backend="cuda")
