"""A PEFT model in one process: unwrap_model through torch.compile, save_model's adapter."""

from __future__ import annotations

import torch

from tests_support import dev_dependency

dev_dependency("transformers")
dev_dependency("peft")

import llm_runs  # noqa: E402

from notebook_accel import Accelerator  # noqa: E402


def test_unwrap_gives_back_the_peft_model_and_save_model_writes_the_adapter(tmp_path):
    from peft import PeftModel

    accelerator = Accelerator(cpu=True)  # the test process may see a GPU; this compares on CPU
    model = llm_runs.lora_model(checkpointing=False)
    prepared = accelerator.prepare(model)
    assert accelerator.unwrap_model(prepared) is model
    assert accelerator.unwrap_model(torch.compile(prepared)) is model  # compile is lazy

    accelerator.save_model(torch.compile(prepared), tmp_path)
    names = {path.name for path in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert "model.safetensors" not in names
    loaded = PeftModel.from_pretrained(
        llm_runs.lora_model(lora=False, checkpointing=False), tmp_path
    )
    ids = torch.randint(0, llm_runs.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
