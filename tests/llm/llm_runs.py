"""A small Llama-style model with a LoRA adapter, packed text, and training runs of it.

Built from a config (nothing downloaded): 2 decoder layers, vocabulary of 384,
about 0.5 M parameters, LoRA of rank 8 on the attention projections. The same
training function runs with notebook_accel's Accelerator or Accelerate's
(`library`), with DDP or FSDP2 sharded per decoder layer (`strategy`).
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import DataLoader

BLOCK = 32  # tokens per packed block
VOCAB = 384
WORDS = (
    "the a one every small large quick slow model worker notebook device gradient "
    "adapter layer token shard batch loss step learns trains saves loads runs waits "
    "on with from into over under after before and or but"
).split()


def corpus(lines: int = 120, seed: int = 0) -> list[str]:
    """Sentences from a fixed word list, the same for a given seed."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "." for _ in range(lines)
    ]


def packed_data(lines: int = 120, block_size: int = BLOCK):
    """A tokenizer trained on the corpus, and the corpus packed into blocks with it."""
    from notebook_accel.training.text import pack_texts, train_tokenizer

    texts = corpus(lines)
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    return tokenizer, pack_texts(texts, tokenizer, block_size)


def lora_model(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = VOCAB,
    lora: bool = True,
    checkpointing: bool = True,
) -> torch.nn.Module:
    """A Llama causal LM from a config, with a LoRA adapter (a `PeftModel`) unless `lora=False`."""
    from peft import LoraConfig, get_peft_model
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
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_checkpointing(model)
    if not lora:
        return model
    adapter = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        # A random B (peft's default is zeros) makes the adapter's gradients flow
        # into A from the first step, so every LoRA weight moves in a short run.
        init_lora_weights="gaussian",
    )
    torch.manual_seed(seed + 1)
    return get_peft_model(model, adapter)


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, as FSDP2 needs)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_checkpointing(model) -> bool:
    """Whether the model recomputes activations in backward."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def fsdp_options(strategy: str) -> dict | None:
    """FullyShardedDataParallelPlugin fields for a strategy name ("ddp": None)."""
    if strategy == "ddp":
        return None
    options = {"transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}
    if strategy == "fsdp-offload":
        options["cpu_offload"] = True
    return options


def make_accelerator(library: str, strategy: str, precision: str, **kwargs):
    """An Accelerator of `library` ("ours" or "accelerate") for the strategy and precision."""
    if library == "accelerate":
        import accelerate
        from accelerate.state import AcceleratorState, GradientState

        # This process was forked from one that may hold Accelerate's singletons.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if strategy != "ddp":
            raise ValueError("Accelerate 1.15 applies FSDP only on GPUs, not to CPU processes")
        return accelerate.Accelerator(cpu=True, mixed_precision=precision, **kwargs)
    from notebook_accel import Accelerator, FullyShardedDataParallelPlugin

    options = fsdp_options(strategy)
    plugin = None if options is None else FullyShardedDataParallelPlugin(**options)
    return Accelerator(mixed_precision=precision, fsdp_plugin=plugin, **kwargs)


def train(
    data,
    library: str = "ours",
    strategy: str = "ddp",
    precision: str = "no",
    batch_size: int = 4,
    epochs: int = 1,
    lr: float = 1e-2,
) -> dict:
    """Train the LoRA model on `data`; per-step losses averaged over the processes, and more.

    `batch_size` is per process; run in one process with `batch_size * processes`
    for the same global batches.
    """
    accelerator = make_accelerator(library, strategy, precision)
    model = lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    loader = DataLoader(data, batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    unwrapped = accelerator.unwrap_model(model)
    adapter = {
        name: tensor.float()
        for name, tensor in accelerator.get_state_dict(model).items()
        if "lora_" in name
    }
    return {
        "losses": losses,
        "adapter": adapter,
        "unwrapped": type(unwrapped).__name__,
        "is_peft": _is_peft(unwrapped),
        "checkpointing": is_checkpointing(unwrapped.get_base_model()),
    }


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)
