"""A tokenizer trained offline with `tokenizers`, and texts packed into blocks."""

from __future__ import annotations

import sys

import pytest
import torch

from tests_support import dev_dependency

dev_dependency("tokenizers")
dev_dependency("transformers")

import llm_runs  # noqa: E402

from notebook_accel.config.optional import MissingDependencyError  # noqa: E402
from notebook_accel.training.text import PackedTokens, pack_texts, train_tokenizer  # noqa: E402


def test_the_tokenizer_round_trips_any_text_and_saves(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = train_tokenizer(llm_runs.corpus(), vocab_size=300)
    assert len(tokenizer) <= 300
    text = "the model trains on every device. Ünïcödé and 123 too!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level: nothing unknown
    common = tokenizer("the model trains", add_special_tokens=False)["input_ids"]
    assert len(common) < len("the model trains")  # merges learned from the corpus
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert (again.eos_token, again.pad_token) == ("</s>", "<pad>")


def test_packing_joins_texts_with_eos_and_cuts_full_blocks():
    texts = llm_runs.corpus(40)
    tokenizer = train_tokenizer(texts, vocab_size=300)
    packed = pack_texts(texts, tokenizer, block_size=16)
    stream = [t for text in texts for t in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]]
    assert isinstance(packed, PackedTokens) and packed.block_size == 16
    assert len(packed) == len(stream) // 16
    assert packed.blocks.flatten().tolist() == stream[: len(packed) * 16]
    item = packed[1]
    assert torch.equal(item["input_ids"], item["labels"])
    batch = next(iter(torch.utils.data.DataLoader(packed, batch_size=3)))
    assert batch["input_ids"].shape == (3, 16)
    with pytest.raises(ValueError, match="fewer than one block"):
        pack_texts(["short"], tokenizer, block_size=512)


def test_without_tokenizers_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match="pip install tokenizers"):
        train_tokenizer(["a b c"])
