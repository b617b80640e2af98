"""Context parallelism with SDPA attention on two GPUs, against one GPU (run by
test_context_parallel.py in its own process, so CUDA starts untouched)."""

from __future__ import annotations

import json
import sys

import torch

from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher


def attention_model(cp_size: int) -> dict:
    config = ParallelismConfig(cp_size=cp_size) if cp_size > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    torch.manual_seed(0)
    embed, mix = torch.nn.Linear(16, 64), torch.nn.Linear(64, 1)
    model = torch.nn.ModuleDict({"embed": embed, "mix": mix})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(2, 128, 16, generator=g).to(accelerator.device)
        y = torch.randn(2, 128, 1, generator=g).to(accelerator.device)
        with accelerator.maybe_context_parallel(buffers=[x, y], buffer_seq_dims=[1, 1]):
            h = model["embed"](x).view(2, 128, 4, 16).transpose(1, 2)  # 4 heads
            h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
            out = model["mix"](h.transpose(1, 2).reshape(2, -1, 64))
            loss = torch.nn.functional.mse_loss(out, y)
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return {"losses": losses}


def main() -> None:
    one = notebook_launcher(attention_model, args=(1,), num_processes=1, backend="cuda")
    results = {"one": one, "gpus": torch.cuda.device_count()}
    if torch.cuda.device_count() >= 2:
        results["split"] = notebook_launcher(
            attention_model, args=(2,), num_processes=2, backend="cuda"
        )
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
