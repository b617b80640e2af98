"""Small models for the big-model tests, built here: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


class Block(nn.Module):
    """A residual block: never to be split across devices."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks, a head tied to the embedding, and a buffer."""

    def __init__(self, vocab: int = 50, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


def save_sharded(model: nn.Module, folder: Path, per_shard: int = 3) -> Path:
    """Save `model` as safetensors shards of `per_shard` tensors plus an index; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if hasattr(model, "head") and hasattr(model, "embed"):
        state.pop("head.weight", None)  # tied: saved once, as checkpoints do
    keys = list(state)
    weight_map = {}
    chunks = [keys[i : i + per_shard] for i in range(0, len(keys), per_shard)]
    for number, chunk in enumerate(chunks, 1):
        name = f"model-{number:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: state[k] for k in chunk}, str(folder / name))
        weight_map.update(dict.fromkeys(chunk, name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index
