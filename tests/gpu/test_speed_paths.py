"""fp8 and the batch copy for real, on a machine with a GPU (skipped elsewhere, saying so).

One prepared run (speed_paths_scenario.py, its own process): fp8 where the GPU
and torchao allow, which must really multiply in float8 (a silent fall back to
bf16 fails here), and prepared loaders pinning and copying ahead on a side
stream without mixing up batches. bench/gpu.py measures the speed.
"""

from __future__ import annotations

import pytest
from gpu_support import needs_a_gpu, run_scenario

pytestmark = [pytest.mark.timeout(600), needs_a_gpu]


@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("speed_paths_scenario.py", timeout=560)


@pytest.fixture(scope="module")
def fp8(scenario) -> dict:
    facts = scenario["fp8"]
    assert facts["ok"], facts.get("traceback")
    return facts


def test_fp8_is_refused_where_the_gpu_or_torchao_cannot(fp8):
    if tuple(fp8["capability"]) >= (8, 9) and fp8["torchao"]:
        pytest.skip("this GPU can run fp8: the next tests check it")
    assert fp8["refused"] and "fp8" in fp8["refused"]
    assert "8.9" in fp8["refused"] or "torchao" in fp8["refused"]


def checked_run(fp8: dict, recipe: str) -> dict:
    if tuple(fp8["capability"]) < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    if not fp8["torchao"]:
        pytest.skip("torchao is not installed here: pip install torchao to check fp8")
    if recipe not in fp8:
        pytest.skip(f"the {recipe} recipe needs compute capability 9.0")
    run = fp8[recipe]
    assert run["ok"], run.get("traceback")
    return run


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_really_multiplies_in_float8(fp8, recipe):
    run = checked_run(fp8, recipe)
    # the two 4096 x 4096 layers are torchao's Float8Linear, compiled; the 16-wide head is not
    assert run["float8"] == ["0", "2"] and run["plain"] == ["4"]
    assert run["compiled"] == ["0", "2"]
    # output, input gradient and weight gradient of each float8 layer go through _scaled_mm
    # (rowwise_with_gw_hp would keep the weight gradient in bf16; neither recipe here does)
    assert run["scaled_mm_calls"] >= 3 * len(run["float8"]), run["scaled_mm_calls"]
    assert run["losses_finite"]


def test_fp8_names_the_layers_it_keeps_in_bf16_once(fp8):
    run = checked_run(fp8, "tensorwise")
    kept = [w for w in run["warnings"] if w.startswith("fp8:")]
    assert kept == [
        "fp8: 1 of 3 Linear layers kept in bf16 (too small for float8 to pay: 4 4096x16)."
    ]


@pytest.fixture(scope="module")
def loaders(scenario) -> dict:
    facts = scenario["loaders"]
    assert facts["ok"], facts.get("traceback")
    return facts


def test_prepared_loaders_pin_and_copy_ahead_by_default(loaders):
    default = loaders["default"]
    assert default["pin_in_copy"] and not default["loader_pins"]
    assert default["non_blocking"] and default["side_stream"]
    assert default["devices"] == ["cuda:0"] and default["values"] == loaders["expected"]


def test_a_loader_pinned_by_the_person_is_not_pinned_again(loaders):
    pinned = loaders["user_pinned"]
    assert pinned["loader_pins"] and not pinned["pin_in_copy"] and pinned["non_blocking"]
    assert pinned["values"] == loaders["expected"]


def test_batches_already_on_the_gpu_and_blocking_copies_still_work(loaders):
    assert loaders["on_gpu_already"]["values"] == loaders["expected"]
    blocking = loaders["blocking"]
    assert not (blocking["non_blocking"] or blocking["side_stream"] or blocking["pin_in_copy"])
    assert blocking["values"] == loaders["expected"]


def test_copies_ahead_never_hand_out_a_half_copied_batch(loaders):
    assert loaders["race_on_side_stream"]  # 16 MiB batches: copied on the side stream
    assert loaders["race_free"]
