"""bench/gpu.py without a GPU: its dry run trains every loop it can, and its table adds up."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_dry_run_trains_every_loop_and_writes_the_table(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model | loop | precision | compiled | steps/s |" in done.stdout
    figures = json.loads(out.read_text())
    rows = figures["rows"]
    assert len(rows) == len(load_bench().variants())
    assert not [row for row in rows if row["error"]], [row["error"] for row in rows]
    ran = [row for row in rows if not row["skipped"]]
    assert all(row["steps_per_s"] > 0 for row in ran)
    loops = {row["loop"] for row in ran}
    assert {"hand-written", "notebook_accel"} <= loops
    # the CPU has no fp8 and the dry run compiles nothing: said, not hidden
    assert all(row["skipped"] for row in rows if row["precision"] == "fp8" or row["compiled"])
    assert figures["launch"] == {"skipped": "dry run"}
    assert figures["environment"]["rounds_done"] == 1
    # the paired comparisons: ours against hand-written, and the hand-written control
    paired = figures["paired"]
    assert [(row["model"], row["loop"]) for row in paired] == [
        ("lm", "notebook_accel"),
        ("lm", "notebook_accel"),
        ("mlp", "notebook_accel"),
        ("lm", "hand-written"),
        ("mlp", "hand-written"),
    ]
    assert all(len(row["ratios"]) == 2 and row["median"] > 0 for row in paired), paired
    assert "| model | precision | loop | median | lowest | highest |" in done.stdout


@pytest.mark.timeout(30)
def test_ratios_compare_with_the_hand_written_loop_and_fp8_with_its_bf16():
    bench = load_bench()
    v = bench.Variant
    results = {
        v("wide", "hand-written", "bf16"): [40.0],
        v("wide", "notebook_accel", "bf16"): [39.0],
        v("wide", "notebook_accel", "fp8"): [52.0],
        v("wide", "notebook_accel", "bf16", compiled=True): [40.0],
        v("wide", "notebook_accel", "fp8", compiled=True): [56.0],
        v("lm", "hand-written", "bf16", pinned=False): [46.0],
        v("lm", "hand-written", "bf16"): [50.0],
        v("lm", "notebook_accel", "bf16", non_blocking=False): [47.0],
        v("lm", "accelerate", "fp8"): [],
    }
    rows = bench.rows_of(
        {
            variant: {"rates": rates, "peaks": [100.0] * len(rates), "float8": "4/4"}
            | ({"skipped": "accelerate is not installed"} if not rates else {})
            for variant, rates in results.items()
        }
    )
    ratio = {(r["model"], r["label"], r["precision"], r["compiled"]): r for r in rows}
    assert ratio["wide", "notebook_accel", "bf16", False]["vs_hand_written"] == 39 / 40
    assert ratio["wide", "notebook_accel", "fp8", False]["vs_own_bf16"] == 52 / 39
    assert ratio["wide", "notebook_accel", "fp8", True]["vs_own_bf16"] == 56 / 40
    assert ratio["wide", "notebook_accel", "fp8", True]["vs_hand_written"] == 56 / 40
    pageable = ratio["lm", "hand-written, pageable + blocking", "bf16", False]
    assert pageable["vs_hand_written"] == 46 / 50
    blocking = ratio["lm", "notebook_accel, non_blocking=False", "bf16", False]
    assert blocking["vs_hand_written"] == 47 / 50
    environment = {
        "gpu": "NVIDIA H200",
        "capability": "9.0",
        "torch": "2.11",
        "cuda": "13.0",
        "torchao": "0.17",
        "accelerate": "1.15.0",
        "rounds_done": 3,
    }
    table = bench.markdown(rows, environment, {"seconds": [2.81, 0.52]})
    assert table.startswith("GPU: NVIDIA H200 (capability 9.0); torch 2.11, CUDA 13.0")
    assert "| wide | notebook_accel | fp8 | no | 52.0 | 1.30x | 1.33x | 4/4 | 100 |" in table
    assert "| lm | accelerate | fp8 | no | - | accelerate is not installed |" in table
    assert table.endswith("forked worker: 2.81 s, then 0.52 s.")


@pytest.mark.timeout(240)
def test_the_breakdown_dry_run_prints_each_view():
    """bench/gpu_breakdown.py on tiny models on the CPU: the loops with one part prepared
    at a time, the calls per step, and (without CUDA) the sync view says it needs a GPU."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("gpu_breakdown.py")), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("lm bf16: steps/s", "mlp no: steps/s", "all prepared", "loader prepared"):
        assert line in done.stdout
    assert "lm bf16: calls per step" in done.stdout
    assert "syncs: needs a CUDA device" in done.stdout
