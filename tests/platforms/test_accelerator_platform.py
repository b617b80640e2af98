"""The generic accelerator platform with more than one device, on the test accelerator
(tests/testaccel): real worker processes, one per device, every CI run.

Each scenario runs in a process of its own that imports the device package first,
as a notebook's kernel would (accelerator_scenario.py); importing it here would make
it the accelerator of every later test in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent

pytestmark = pytest.mark.timeout(300)


def run_scenario(name: str) -> dict:
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    # On a GPU machine the GPUs are hidden: these workers must run on the test devices.
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "NOTEBOOK_ACCEL_TEST_DEVICES": "4",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("NOTEBOOK_ACCEL_START_METHOD", None)
    result = subprocess.run(
        [sys.executable, str(HERE / "accelerator_scenario.py"), name],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_rank_r_trains_on_device_r_and_the_launch_refuses_what_cannot_run():
    seen = run_scenario("placement")
    assert seen["accelerator"] == "testaccel" and seen["count"] == 4
    assert seen["precisions"] == ["bf16"]
    # Accelerator() in the kernel trains on the device, as a notebook's first cell would.
    assert seen["in_kernel"] == "testaccel:0" and seen["process_platform"] == "testaccel"
    four = seen["four"]
    assert [r["device"] for r in four] == [f"testaccel:{rank}" for rank in range(4)]
    for rank, report in enumerate(four):
        assert report["rank"] == rank and report["current_index"] == rank
        assert report["tensor"] == report["device"] and report["platform"] == "testaccel"
        assert report["backend"] == "testccl" and report["gathered"] == [0, 1, 2, 3]
    # Each worker's peak device memory, read through torch.accelerator's memory API.
    assert len(seen["peak_bytes"]) == 4 and all(peak > 0 for peak in seen["peak_bytes"])
    assert [r["device"] for r in seen["chosen"]] == ["testaccel:1", "testaccel:3"]
    assert (
        "num_processes=5 asks for one testaccel device per worker, but this machine has 4"
        in seen["too_many"]
    )
    assert "Pass num_processes=4 or fewer" in seen["too_many"]
    assert "testaccel autocast does not take fp16" in seen["fp16"]
    assert "use mixed_precision='bf16'" in seen["fp16"]
    # Untouched, the kernel forks its workers; once it used the device, a clean process
    # does, with the device's own reason, and the workers still get their devices.
    assert seen["untouched_start"] == "fork"
    assert seen["touched_start"] == "forkserver"
    assert "testaccel is already initialised in this process" in seen["touched_reason"]
    assert [r["device"] for r in seen["touched_run"]] == ["testaccel:0", "testaccel:1"]
    assert "start_method='fork' cannot work here: testaccel is already" in seen["forced_fork"]


def test_ddp_on_the_device_is_bit_identical_to_cpu_workers_and_metrics_gather_once():
    seen = run_scenario("ddp")
    assert seen["device"] == "testaccel:0" and seen["wrapped"] == "DistributedDataParallel"
    assert seen["identical"] and seen["moved"]
    assert seen["seen"] == [float(value) for value in range(9)]


def test_save_state_and_load_state_resume_exactly_with_the_device_generators():
    seen = run_scenario("resume")
    whole, resumed = seen["whole"], seen["resumed"]
    assert "testaccel" in whole["rng_keys"]
    assert resumed["losses"] == whole["losses"][3:]
    assert whole["autocast_dtype"] == "torch.bfloat16"


def test_device_map_spreads_over_the_devices_and_a_pipeline_runs_on_two():
    seen = run_scenario("big_model")
    assert seen["device_map"] == {"0": "0", "1": "1", "2": "2", "3": "3"}
    assert seen["weights_on"] == [f"testaccel:{index}" for index in range(4)]
    assert seen["equal"] and seen["pipelined_equal"]
    assert seen["free_by_index"] == ["0", "1", "2", "3", "cpu"]
    assert "names device 7, but this machine has 4 visible testaccel device(s)" in seen["bad_index"]


def test_live_workers_the_panel_and_the_env_report_see_the_devices():
    seen = run_scenario("live_panel_env")
    assert seen["live"] == ["testaccel:0", "testaccel:1"]
    assert seen["cell"] == ["testaccel:0", "testaccel:1"]
    assert seen["backends"] == ["testaccel", "cpu"]
    assert seen["boxes"] == [f"testaccel:{index}" for index in range(4)]
    assert "accelerator     testaccel" in seen["env"]
    assert "testaccel       4 device(s) (Test accelerator); autocast: bf16" in seen["env"]
