"""No host-device synchronisation in a prepared training step, on a real GPU (skipped
elsewhere, saying so; tests/accelerator/test_no_host_reads.py checks the same steps
on the CPU).

One prepared run (step_syncs_scenario.py, its own process): after warm-up, steps
with the prepared model, optimizer and loader (accumulate, backward, step,
zero_grad, gather_for_metrics, log of a number) under
torch.cuda.set_sync_debug_mode("error") in fp32, bf16 (accumulating too, small
batches and large ones copied on the side stream), fp16 with a fused optimizer, and
fp8 where the GPU and torchao allow. Under fp16 with a plain optimizer torch's
GradScaler reads the overflow flag once per step (a hand-written loop does too):
that is the only synchronisation there.
"""

from __future__ import annotations

import pytest
from gpu_support import needs_a_gpu, run_scenario

pytestmark = [pytest.mark.timeout(600), needs_a_gpu]

STRICT = ["fp32", "bf16", "bf16_accumulating", "bf16_large_batches", "fp16_fused"]


@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("step_syncs_scenario.py", timeout=560)


@pytest.mark.parametrize("case", STRICT)
def test_a_prepared_step_never_waits_for_the_gpu(scenario, case):
    run = scenario[case]
    assert run["ok"], run.get("traceback")  # a synchronisation raised, with its line
    assert run["syncs"] == [] and run["gathered"] > 0


def test_large_batches_take_the_side_stream_and_small_ones_do_not(scenario):
    assert scenario["bf16_large_batches"]["side_stream"]
    assert not scenario["bf16"]["side_stream"]


def test_under_fp16_with_a_plain_optimizer_only_torchs_grad_scaler_waits(scenario):
    run = scenario["fp16_plain"]
    assert run["ok"], run.get("traceback")
    assert run["syncs"], "GradScaler reads the overflow flag of a plain optimizer's step"
    assert all("grad_scaler.py" in where for where in run["syncs"]), run["syncs"]
    assert len(run["syncs"]) == 6  # once per recorded step


def test_fp8_steps_never_wait_for_the_gpu(scenario):
    if "fp8" not in scenario:
        pytest.skip("fp8 needs compute capability 8.9 and torchao")
    assert scenario["fp8"]["ok"], scenario["fp8"].get("traceback")
