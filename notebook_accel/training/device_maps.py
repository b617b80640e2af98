"""Models already placed by a device map (`hf_device_map`), as `prepare` meets them.

A model spread over devices by `dispatch_model`, `load_checkpoint_and_dispatch` or
transformers' `from_pretrained(device_map=...)` stays where its map put it: moving
it to one device would undo the map. An 8-bit or 4-bit (bitsandbytes) model with a
map is checked before training, as Accelerate checks it: its quantized weights
cannot be trained offloaded, across devices in a distributed run, or on another
device than this process's.
"""

from __future__ import annotations

import torch
from torch import nn

from notebook_accel.platforms import probes


def spread_by_device_map(model: nn.Module) -> bool:
    """Whether `model` or a submodule has a device map of more than one entry."""
    return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())


def is_quantized(model: nn.Module) -> bool:
    """Whether transformers loaded `model` in 8-bit or 4-bit precision (bitsandbytes)."""
    return bool(
        getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    )


def check_quantized_placement(model: nn.Module, device: torch.device, distributed: bool) -> None:
    """Refuse a quantized model whose device map it cannot be trained with, saying why."""
    placements = set((getattr(model, "hf_device_map", None) or {}).values())
    if not placements:
        return
    listed = sorted(map(str, placements))
    bnb_on_cpu = device.type == "cpu" and probes.is_bitsandbytes_multi_backend_available()
    if "disk" in placements or ("cpu" in placements and not bnb_on_cpu):
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with "
            f"CPU or disk offload (its hf_device_map places modules on {listed}). "
            f"Load it whole on this process's device, device_map={{'': '{device}'}}, "
            "or, to train on the CPU, install a bitsandbytes that runs there."
        )
    if len(placements) > 1 and distributed:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on "
            f"multiple devices in a distributed run (its hf_device_map uses {listed}). "
            f"Give each process the whole model, device_map={{'': '{device}'}}, or train it "
            "in one process, its layers spread over the devices (naive pipeline parallelism)."
        )
    if len(placements) == 1 and not bnb_on_cpu:
        (where,) = placements
        index = torch.device(where).index if isinstance(where, (str, torch.device)) else where
        placed = (
            torch.device(device.type, index) if index is not None else torch.device(device.type)
        )
        # a model on the first device is accepted by a process whose device has no index
        if placed != device and (device.index is not None or index not in (0, None)):
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision on a "
                f"different device than the one you're training on ({where} for {device}). "
                f"Load it with device_map={{'': '{device}'}}."
            )
