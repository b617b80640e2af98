"""A transformers Llama split over two gloo workers with tensor parallelism (its own
`tp_plan`, applied by `from_pretrained` on the Accelerator's "tp" mesh) trains as
the same model in one process."""

from __future__ import annotations

import pytest
import torch
from llm_runs import lora_model

from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def train(path: str, tp_size: int) -> dict:
    from transformers import LlamaForCausalLM

    config = ParallelismConfig(tp_size=tp_size) if tp_size > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    split = {}
    if tp_size > 1:  # transformers splits it as it loads, by the model's own tp_plan
        split = {"tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh["tp"]}
    model = LlamaForCausalLM.from_pretrained(path, **split)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    split_layers = sum(
        type(p).__name__ == "DTensor" for p in accelerator.unwrap_model(model).parameters()
    )
    return {
        "losses": losses,
        "weights": accelerator.get_state_dict(model),
        "split": split_layers,
    }


def test_llama_split_over_two_with_tp_trains_as_one_process(tmp_path):
    path = str(tmp_path / "llama")
    lora_model(vocab=64, hidden=32, lora=False, checkpointing=False).save_pretrained(path)
    alone = notebook_launcher(train, args=(path, 1), num_processes=1, backend="cpu")
    split = notebook_launcher(train, args=(path, 2), num_processes=2, backend="cpu", timeout=240)
    assert alone["split"] == 0 and split["split"] > 0  # its attention and MLP projections
    # within float tolerance: a split projection adds its partial sums in another order
    # (measured: losses 5e-7 apart, weights 4e-8 after three AdamW steps)
    assert split["losses"] == pytest.approx(alone["losses"], abs=1e-5)
    assert split["weights"].keys() == alone["weights"].keys()
    for name, reference in alone["weights"].items():
        torch.testing.assert_close(split["weights"][name], reference, atol=1e-5, rtol=0)
