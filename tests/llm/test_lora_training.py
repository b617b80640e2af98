"""LoRA fine-tuning of a transformers causal LM on two CPU workers, against Accelerate.

One launch trains the same Llama-style model with the same LoRA adapter
(gradient checkpointing on) on the same packed blocks: with notebook_accel's
DDP, with Accelerate 1.15's DDP, with FSDP2 sharded per decoder layer, and
with FSDP2 and CPU offload. Accelerate 1.15 applies FSDP only on GPUs, so on
CPU processes its DDP run is the reference for all of them. One process with
the global batch is the other reference.

Workers import transformers, so these launches pass `warm=False`: the kernel
does not import the workers' modules in the background afterwards (see
launch/warm.py), and the test process imports transformers itself.
"""

from __future__ import annotations

import pytest

from tests_support import dev_dependency

dev_dependency("transformers")
dev_dependency("peft")
dev_dependency("accelerate")

import llm_runs  # noqa: E402

from notebook_accel import notebook_launcher  # noqa: E402
from notebook_accel.training.text import PackedTokens  # noqa: E402

RUNS = [
    ("accelerate", "ddp"),
    ("ours", "ddp"),
    ("ours", "fsdp"),
    ("ours", "fsdp-offload"),
]


@pytest.fixture(scope="module")
def data() -> PackedTokens:
    _, packed = llm_runs.packed_data()
    return PackedTokens(packed.blocks[:48])  # 6 global batches of 8, none uneven


def _every_run(data, precision: str) -> dict:
    return {
        f"{library} {strategy}": llm_runs.train(data, library, strategy, precision)
        for library, strategy in RUNS
        if not (precision == "bf16" and strategy == "fsdp-offload")
    }


def _launch(data, precision: str) -> dict:
    return notebook_launcher(
        _every_run,
        args=(data, precision),
        num_processes=2,
        backend="cpu",
        live=False,
        warm=False,
        timeout=150,
    )


def _largest_difference(ours: dict, theirs: dict) -> float:
    return max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))


@pytest.mark.timeout(200)
def test_lora_losses_match_accelerate_fsdp2_and_one_process_in_fp32(data):
    runs = _launch(data, "no")
    one_process = llm_runs.train(data, "ours", "ddp", "no", batch_size=8)
    reference = runs["accelerate ddp"]
    print("Accelerate DDP losses", [round(v, 6) for v in reference["losses"]])
    assert len(reference["losses"]) == 6
    assert reference["losses"][-1] < reference["losses"][0]  # it learns
    for name, run in runs.items():
        print(f"{name:24s} largest loss difference {_largest_difference(run, reference):.2e}")
        assert _largest_difference(run, reference) <= 1e-5, name
        assert _largest_difference(run, one_process) <= 1e-5, name
        assert run["is_peft"], f"{name}: unwrap_model gave a {run['unwrapped']}"
        assert run["checkpointing"], name
        assert sorted(run["adapter"]) == sorted(reference["adapter"])
        for key, tensor in run["adapter"].items():
            assert (tensor - reference["adapter"][key]).abs().max() <= 1e-5, (name, key)
    assert runs["ours fsdp"]["unwrapped"] == "FSDPPeftModel"  # the same object, resharded


@pytest.mark.timeout(200)
def test_lora_in_bf16_follows_accelerate(data):
    runs = _launch(data, "bf16")
    fp32 = llm_runs.train(data, "ours", "ddp", "no", batch_size=8)
    reference = runs["accelerate ddp"]
    for name, run in runs.items():
        print(f"{name:24s} bf16 vs Accelerate {_largest_difference(run, reference):.2e}")
        assert run["is_peft"]
    # The same autocast as Accelerate's: the same losses.
    assert _largest_difference(runs["ours ddp"], reference) <= 1e-5
    # FSDP2 computes in bf16 parameters (Accelerate's DDP autocasts): close, not equal.
    assert _largest_difference(runs["ours fsdp"], reference) <= 2e-2
    assert _largest_difference(reference, fp32) <= 2e-2
