"""Memory per process of fine-tuning a Llama-style model on 2 workers: DDP vs FSDP2.

A causal LM built from a config (nothing downloaded; default: 4 decoder
layers, hidden size 256, vocabulary 8,000, about 7 M parameters) is trained
for one step with LoRA (rank 8 on the attention projections) and with every
weight trainable, under DDP, FSDP2 sharded per decoder layer, and FSDP2 with
CPU offload. Each process then counts the bytes it holds of parameters,
gradients and AdamW state (`notebook_accel.footprint`); the table shows rank
0's, each total as a ratio of DDP's.

    python bench/llm_memory.py [--hidden 256] [--layers 4] [--vocab 8000] [--json out.json]

On a machine without GPUs the device is the CPU, so "on device" counts
everything, offloaded or not; on GPUs offloaded bytes leave that column.
"""

from __future__ import annotations

import argparse
import json
import sys

STRATEGIES = ("DDP", "FSDP2", "FSDP2 + CPU offload")


def _model(hidden: int, layers: int, vocab: int, lora: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    return get_peft_model(model, adapter)


def _plugin(strategy: str):
    from notebook_accel import FullyShardedDataParallelPlugin

    if strategy == "DDP":
        return None
    return FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        cpu_offload=strategy.endswith("offload"),
    )


def footprints(hidden: int, layers: int, vocab: int, lora: bool) -> dict[str, dict]:
    """In each worker: one training step per strategy, then this process's footprint."""
    import torch

    from notebook_accel import Accelerator
    from notebook_accel.footprint import training_footprint

    result = {}
    for strategy in STRATEGIES:
        accelerator = Accelerator(fsdp_plugin=_plugin(strategy))
        model = _model(hidden, layers, vocab, lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        model, optimizer = accelerator.prepare(model, optimizer)
        tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()  # AdamW's state exists from here; gradients until zero_grad
        result[strategy] = training_footprint(model, optimizer, accelerator.device).as_dict()
        optimizer.zero_grad()
        accelerator.free_memory()
    return result


def measure(hidden: int = 256, layers: int = 4, vocab: int = 8000) -> dict[str, dict]:
    """Rank 0's footprint for "LoRA" and "full" fine-tuning under each strategy, 2 CPU workers."""
    from notebook_accel import notebook_launcher

    return {
        kind: notebook_launcher(
            footprints,
            args=(hidden, layers, vocab, kind == "LoRA"),
            num_processes=2,
            backend="cpu",
            live=False,
            warm=False,  # the workers import transformers (see launch/warm.py)
            timeout=300,
        )
        for kind in ("LoRA", "full")
    }


def table(figures: dict[str, dict]) -> str:
    """One Markdown table of every run, totals as ratios of the same kind's DDP."""
    from notebook_accel.footprint import MemoryFootprint, footprint_table

    blocks = []
    for kind, rows in figures.items():
        footprints = {
            f"{kind}, {name}": MemoryFootprint(**{k: v for k, v in row.items() if k != "total"})
            for name, row in rows.items()
        }
        text = footprint_table(footprints, reference=f"{kind}, DDP")
        blocks.append(text if not blocks else text.split("\n", 2)[2])
    return "\n".join(blocks).replace(f"vs {next(iter(figures))}, DDP", "vs DDP")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    figures = measure(args.hidden, args.layers, args.vocab)
    print(table(figures))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
