"""Memory per process, DDP vs FSDP2, for LoRA and full fine-tuning on 2 CPU workers.

Runs bench/llm_memory.py's measurement on a smaller model and prints its table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from notebook_accel.training.footprint import MemoryFootprint, footprint_table, training_footprint
from tests_support import dev_dependency

SCRIPT = Path(__file__).parents[2] / "bench" / "llm_memory.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_llm_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_llm_memory"] = module
    spec.loader.exec_module(module)
    return module


def test_footprint_counts_parameters_gradients_and_adamw_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].weight.requires_grad_(False)  # frozen: no gradient, no optimizer state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert training_footprint(model, optimizer, "cpu") == MemoryFootprint(
        (32 + 8 + 16 + 2) * 4, 0, 0, (32 + 8 + 16 + 2) * 4
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    footprint = training_footprint(model, optimizer, "cpu")
    trainable = (32 + 8 + 2) * 4
    assert footprint.gradients == trainable
    assert footprint.optimizer_state == 2 * trainable  # exp_avg and exp_avg_sq; steps left out
    assert footprint.total == footprint.on_device
    assert training_footprint(model, optimizer, "cuda").on_device == 0
    table = footprint_table({"a": footprint, "b": footprint}, reference="a")
    assert table.splitlines()[-1].endswith("| 1.000x |")


@pytest.mark.timeout(200)
def test_fsdp2_holds_at_most_0_55_of_ddp_per_process():
    dev_dependency("transformers")
    dev_dependency("peft")
    bench = _bench()
    figures = bench.measure(hidden=128, layers=2, vocab=2000)
    print()
    print(bench.table(figures))
    for kind, rows in figures.items():
        ddp = rows["DDP"]["total"]
        for strategy in ("FSDP2", "FSDP2 + CPU offload"):
            assert rows[strategy]["total"] <= 0.55 * ddp, (kind, strategy, rows)
            assert rows[strategy]["parameters"] <= 0.55 * rows["DDP"]["parameters"]
        assert rows["DDP"]["optimizer_state"] == 2 * rows["DDP"]["gradients"]  # AdamW
