"""Text for language-model training: a tokenizer trained offline, and packed token blocks.

`train_tokenizer` trains a byte-level BPE tokenizer on the texts given with
the `tokenizers` package (nothing is downloaded: every byte is in its
alphabet, so any text encodes) and wraps it as a transformers
`PreTrainedTokenizerFast`, which saves and loads like any Hub tokenizer.
`pack_texts` tokenises texts, joins them with the end-of-text token and cuts
the stream into blocks of `block_size` tokens, the usual way causal language
models are fine-tuned (no padding, every token trains). The blocks are a map-
style dataset, so prepared loaders shard, shuffle and resume them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from notebook_accel.config.optional import require

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


@contextlib.contextmanager
def _serial_tokenizers() -> Iterator[None]:
    # A tokenizer that ran in parallel before a fork makes every forked worker
    # print a warning and turn parallelism off (huggingface/tokenizers#537); the
    # small texts here gain nothing from threads, so they are tokenised without.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> Any:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens trained on `texts`.

    Returns a transformers `PreTrainedTokenizerFast` with `<s>`, `</s>`,
    `<unk>` and `<pad>` as its bos, eos, unk and pad tokens. Needs the
    `tokenizers` and `transformers` packages.
    """
    tokenizers = require("tokenizers", "train_tokenizer")
    transformers = require("transformers", "train_tokenizer")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _serial_tokenizers():
        tokenizer.train_from_iterator(list(texts), trainer=trainer)
    unk, bos, eos, pad = SPECIAL_TOKENS
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=unk, bos_token=bos, eos_token=eos, pad_token=pad
    )


class PackedTokens(torch.utils.data.Dataset):
    """Blocks of token ids, each item `{"input_ids": block, "labels": block}`.

    Labels equal the inputs: a transformers causal LM shifts them itself.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dim() != 2:
            raise ValueError(f"blocks must be 2-d (blocks x block_size), not {tuple(blocks.shape)}")
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.blocks.shape[1]


def pack_texts(texts: Sequence[str], tokenizer: Any, block_size: int) -> PackedTokens:
    """Tokenise `texts`, join them with the tokenizer's eos token and cut blocks of `block_size`.

    The last tokens that do not fill a block are dropped (as transformers'
    examples do). Raises ValueError when the texts do not fill one block.
    """
    if block_size < 2:
        raise ValueError(f"block_size={block_size}; a causal LM needs at least 2 tokens a block.")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token to separate the texts with.")
    with _serial_tokenizers():
        encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    stream = [token for ids in encoded for token in [*ids, eos]]
    count = len(stream) // block_size
    if count == 0:
        raise ValueError(
            f"the texts make {len(stream)} tokens, fewer than one block of {block_size}."
        )
    blocks = torch.tensor(stream[: count * block_size], dtype=torch.long)
    return PackedTokens(blocks.view(count, block_size))
