"""Model skeletons without memory: parameters created on the meta device (or any device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def init_on_device(
    device: torch.device | str, include_buffers: bool | None = None
) -> Iterator[None]:
    """Create the parameters of modules built inside on `device` (and buffers too if asked).

    With `include_buffers=True` every tensor created inside goes there, through torch's
    own default-device context. Otherwise only parameters do: buffers such as rotary
    tables stay real, since they are computed, not loaded.
    """
    device = torch.device(device)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            kind = type(module._parameters[name])
            extra = {"requires_grad": param.requires_grad}
            moved = module._parameters[name].to(device)
            module._parameters[name] = kind(moved, **extra) if kind is nn.Parameter else moved

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models inside with parameters on the meta device: no memory, no random init.

        with init_empty_weights():
            model = MyBigModel(config)   # instant, whatever its size

    Load real weights afterwards with `load_checkpoint_and_dispatch`.
    """
    with init_on_device("meta", include_buffers=bool(include_buffers)):
        yield
