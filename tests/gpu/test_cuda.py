"""CUDA behaviour, checked on a machine with GPUs (skipped elsewhere, saying so).

One prepared run (cuda_scenario.py, its own process so CUDA starts untouched)
covers: counting GPUs without initialising CUDA, forked workers on nccl, fp16
with loss scaling, bf16 and fp8 where the GPU can, GPU memory figures, and
workers forked from a clean template process once the kernel has initialised
CUDA (a model on the kernel's GPU trained on every GPU).
"""

from __future__ import annotations

import pytest
from gpu_support import needs_a_gpu, run_scenario

pytestmark = [pytest.mark.timeout(900), needs_a_gpu]


@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("cuda_scenario.py", timeout=850)


def capability(scenario) -> tuple[int, int]:
    return min(tuple(gpu[2]) for gpu in scenario["gpus"])


def test_gpus_are_counted_without_initialising_cuda(scenario):
    assert scenario["gpus"]
    assert scenario["cuda_initialized_after_detect"] is False
    assert scenario["cuda_initialized_after_launches"] is False


def test_warming_after_gpu_launches_leaves_cuda_untouched(scenario):
    warming = scenario["warming"]
    assert warming["finished"] and warming["status"] == "done", warming
    assert warming["dynamo_here"] and warming["cuda_clean_after_warming"]


def test_forked_workers_train_with_gpu_memory_figures(scenario):
    """One worker per GPU, up to two: one GPU shows the forked path, two an nccl group."""
    run = scenario["no"]
    assert run["ok"], run.get("traceback")
    assert run["device"].startswith("cuda")
    assert run["world"] == min(len(scenario["gpus"]), 2)
    assert run["reduced"] == run["world"]
    assert all(figures["peak_gpu_bytes"] > 0 for figures in run["resources"].values())


def test_two_gpus_form_one_nccl_group(scenario):
    if len(scenario["gpus"]) < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one GPU")
    assert scenario["no"]["distributed_type"] == "MULTI_GPU"


def test_one_process_runs_in_the_kernel_on_the_gpu(scenario):
    run = scenario["in_kernel"]
    assert run["ok"], run.get("traceback")
    assert run["pid_is_kernel"] and run["device"].startswith("cuda")
    assert run["world"] == 1 and run["distributed_type"] == "NO"


def test_fp16_trains_with_a_loss_scaler(scenario):
    run = scenario["fp16"]
    assert run["ok"], run.get("traceback")
    assert run["precision"] == "fp16" and run["layer_dtype"] == "torch.float16"


def test_bf16_where_the_gpu_has_it(scenario):
    run = scenario["bf16"]
    if capability(scenario) >= (8, 0):
        assert run["ok"], run.get("traceback")
        assert run["layer_dtype"] == "torch.bfloat16"
    else:
        assert not run["ok"] and "bf16 needs compute capability 8.0" in run["error"]


def test_fp8_runs_or_names_what_is_missing(scenario):
    run = scenario["fp8"]
    if run["ok"]:
        assert run["precision"] == "fp8"
    else:
        assert "fp8" in run["error"] and ("torchao" in run["error"] or "8.9" in run["error"])


def test_after_cuda_started_here_a_model_on_the_gpu_trains_in_fresh_interpreters(scenario):
    run = scenario["after_cuda_init"]
    assert run["ok"], run.get("traceback")
    assert run["start_method"] == "forkserver"
    assert "CUDA is already initialised" in run["fresh_start_reason"]
    assert "cuda_scenario.py" in run["fresh_start_reason"]  # the line that started it
    assert any("clean process started once" in text for text in run["warnings"])
    # Each worker got the kernel's model on its own GPU, the one it trains on.
    assert run["received_on"] == run["device"] == "cuda:0"
    print(f"fork launch {scenario['no']['seconds']:.2f} s, fresh {run['seconds']:.2f} s")


def test_forking_after_cuda_started_here_is_refused_with_the_way_out(scenario):
    run = scenario["fork_after_cuda_init"]
    assert not run["ok"]
    assert "start_method='fork' cannot work here" in run["error"]
