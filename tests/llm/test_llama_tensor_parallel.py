"""A transformers Llama split over two gloo workers with tensor parallelism trains as the
same model in one process, whether transformers splits it as it loads
(`from_pretrained(..., tp_plan="auto")` on the Accelerator's "tp" mesh) or `prepare()`
splits it by the model's own `tp_plan`."""

from __future__ import annotations

import pytest
import torch
from llm_runs import lora_model

from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def train(path: str, tp_size: int, split_by: str) -> dict:
    from transformers import LlamaForCausalLM

    config = ParallelismConfig(tp_size=tp_size) if tp_size > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    split = {}
    if split_by == "from_pretrained":  # transformers splits it as it loads
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
    unwrapped = accelerator.unwrap_model(model)
    split_layers = sum(type(p).__name__ == "DTensor" for p in unwrapped.parameters())
    return {
        "losses": losses,
        "weights": accelerator.get_state_dict(model),
        "split": split_layers,
        "tied": unwrapped.lm_head.weight is unwrapped.model.embed_tokens.weight,
    }


def _assert_trains_as(split: dict, alone: dict) -> None:
    assert alone["split"] == 0 and split["split"] > 0
    # within float tolerance: a split projection adds its partial sums in another order
    # (measured: losses 5e-7 apart; weights 1.3e-5 after three AdamW steps, whose
    # updates are a thousandth each, so a tenth of one)
    assert split["losses"] == pytest.approx(alone["losses"], abs=1e-5)
    assert split["weights"].keys() == alone["weights"].keys()
    for name, reference in alone["weights"].items():
        torch.testing.assert_close(split["weights"][name], reference, atol=1e-4, rtol=0)


def _llama(directory, tied: bool) -> str:
    model = lora_model(vocab=64, hidden=48, lora=False, checkpointing=False)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    path = str(directory / ("tied" if tied else "untied"))
    model.save_pretrained(path)
    return path


def _runs(path: str) -> dict:
    two = {"num_processes": 2, "backend": "cpu", "timeout": 240}
    return {
        "alone": notebook_launcher(train, args=(path, 1, ""), num_processes=1, backend="cpu"),
        "from_pretrained": notebook_launcher(train, args=(path, 2, "from_pretrained"), **two),
        "prepare": notebook_launcher(train, args=(path, 2, "prepare"), **two),
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_llama_split_by_prepare_or_as_it_loads_trains_as_one_process(tmp_path, tied):
    runs = _runs(_llama(tmp_path, tied))
    # its attention and MLP projections, its embedding and its output layer (one weight
    # when tied, which stays tied)
    assert runs["prepare"]["split"] == 2 * 7 + (1 if tied else 2)
    assert runs["prepare"]["tied"] == runs["alone"]["tied"] == tied
    _assert_trains_as(runs["from_pretrained"], runs["alone"])
    # prepare() splits it as transformers does, so they train bit for bit alike
    assert runs["prepare"]["losses"] == runs["from_pretrained"]["losses"]
    for name, reference in runs["from_pretrained"]["weights"].items():
        assert torch.equal(runs["prepare"]["weights"][name], reference), name
