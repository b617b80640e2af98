"""PEFT models (LoRA and other adapters): `save_model` writes the adapter in peft's format.

A `peft.PeftModel` trains a small adapter on a frozen base model; what is
worth saving is the adapter, as `adapter_config.json` and
`adapter_model.safetensors`, the files `PeftModel.from_pretrained` reads.
Nothing here imports peft: a PEFT model is recognised by its `peft_config` and
`save_pretrained`, so plain models never pay for the import.

With FSDP the adapter's weights are shards on every process; `adapter_state_dict`
gathers only the adapter (not the base model) and every process must call it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from notebook_accel.training import fsdp


def is_peft_model(model: Any) -> bool:
    """Whether `model` (unwrapped) is a peft `PeftModel`."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(
        getattr(model, "save_pretrained", None)
    )


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's whole weights under the model's own key names (a collective if sharded).

    Which keys are the adapter's is peft's decision (`get_peft_model_state_dict`,
    which may also add trained embeddings or `modules_to_save`).
    """
    from notebook_accel.config.optional import require

    peft_utils = require("peft.utils", "saving a PEFT model")
    local = model.state_dict()  # DTensor shards for a sharded model: no communication yet
    chosen = {id(t) for t in peft_utils.get_peft_model_state_dict(model, state_dict=local).values()}
    if not chosen & {id(t) for t in local.values()}:  # peft made copies: gather everything
        chosen = {id(t) for t in local.values()}
    # Every process walks the same keys in the same order, so the gathers pair up.
    return {
        key: fsdp.full_tensor(value).detach().cpu()
        for key, value in local.items()
        if id(value) in chosen
    }


def save_adapter(
    model: Any,
    save_directory: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    safe_serialization: bool = True,
) -> None:
    """Write the adapter with peft's own `save_pretrained` (on the main process only)."""
    model.save_pretrained(
        os.fspath(save_directory), state_dict=state_dict, safe_serialization=safe_serialization
    )
