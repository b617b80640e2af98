"""Saving a LoRA run on two CPU workers: the adapter in peft's format, and exact resume.

Each worker trains the LoRA model for two epochs of shuffled packed blocks
through a stateful loader (`use_stateful_dataloader=True`), once without
stopping, once stopping after a save in the middle of the second epoch; a
fresh model, optimizer and loader then load that checkpoint and finish. The
resumed run must give the very same losses and adapter. `save_model` must
write what `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json

import pytest

from tests_support import dev_dependency

dev_dependency("transformers")
dev_dependency("peft")
dev_dependency("torchdata")

import llm_runs  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from notebook_accel import DataLoaderConfiguration, notebook_launcher  # noqa: E402
from notebook_accel.training.text import PackedTokens  # noqa: E402

EPOCHS, STOP_AT = 2, 8  # 6 steps an epoch: the save is the 2nd step of epoch 2


def _prepared(strategy: str, data):
    accelerator = llm_runs.make_accelerator(
        "ours",
        strategy,
        "no",
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model = llm_runs.lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(5)  # the shuffle order
    loader = DataLoader(data, batch_size=4, shuffle=True)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _train(strategy: str, data, directory: str, stop_at: int | None, resume: bool) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    accelerator, model, optimizer, loader = _prepared(strategy, data)
    assert isinstance(loader, StatefulDataLoader)
    if resume:
        accelerator.load_state(directory)
    losses, step, saved = [], 0, None
    for _ in range(loader.epoch, EPOCHS):  # a resumed loader knows its epoch
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            step += 1
            if step == stop_at:
                accelerator.save_state(directory)
                saved = loader.state_dict()
                return {"losses": losses, "loader_state": saved}
    accelerator.save_model(model, f"{directory}-adapter")
    adapter = {k: v for k, v in accelerator.get_state_dict(model).items() if "lora_" in k}
    return {"losses": losses, "adapter": adapter}


def _stop_and_resume(strategy: str, data, directory: str) -> dict:
    return {
        "whole": _train(strategy, data, directory + "-whole", None, False),
        "stopped": _train(strategy, data, directory, STOP_AT, False),
        "resumed": _train(strategy, data, directory, None, True),
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_mid_epoch_is_exact_and_the_adapter_loads_in_peft(strategy, tmp_path):
    from peft import PeftModel

    _, packed = llm_runs.packed_data()
    data = PackedTokens(packed.blocks[:48])
    runs = notebook_launcher(
        _stop_and_resume,
        args=(strategy, data, str(tmp_path / "ckpt")),
        num_processes=2,
        backend="cpu",
        live=False,
        warm=False,
        timeout=150,
    )
    whole, stopped, resumed = runs["whole"], runs["stopped"], runs["resumed"]
    assert len(whole["losses"]) == EPOCHS * 6
    # torchdata's state, as Accelerate's: the batches handed out this epoch
    state = stopped["loader_state"]
    assert state["_num_yielded"] == STOP_AT - 6 and state["_sampler_iter_yielded"] == STOP_AT - 6
    assert stopped["losses"] + resumed["losses"] == whole["losses"]  # bit for bit
    for key, tensor in whole["adapter"].items():
        assert torch.equal(tensor, resumed["adapter"][key]), key

    # save_model wrote peft's files, and peft loads them into a fresh base model.
    folder = tmp_path / "ckpt-adapter"
    assert {p.name for p in folder.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert not (folder / "model.safetensors").exists()
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
    base = llm_runs.lora_model(lora=False, checkpointing=False)
    loaded = PeftModel.from_pretrained(base, str(folder))
    weights = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert sorted(weights) == sorted(resumed["adapter"])
    for key, tensor in weights.items():
        assert torch.equal(tensor, resumed["adapter"][key]), key
