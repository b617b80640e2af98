"""Text for language-model fine-tuning: a tokenizer trained offline, texts packed into blocks.

The public path of `notebook_accel.training.text`; names are imported on first use.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

_EXPORTS = {
    name: "notebook_accel.training.text"
    for name in ("train_tokenizer", "PackedTokens", "pack_texts")
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
