"""CUDA's lazy start and its NVML count, which keep the kernel fork-safe
(notebook_accel/platforms/cuda.py, cuda_origin.py).

torch starts CUDA through `torch.cuda._lazy_init`, the one Python function through
which it does (tensor creation in C++ calls it by name too): replacing it catches the
code that would start CUDA in the kernel. `torch.cuda._device_count_nvml` counts GPUs
without starting CUDA where `torch.cuda.device_count()` would fall back to the CUDA
runtime (MIG UUIDs in CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from notebook_accel.internals.api import PrivateApi, has, missing_error

LAZY_INIT = "_lazy_init"


def is_compiled() -> bool:
    """Whether this torch was built with CUDA (without starting it)."""
    import torch

    check = getattr(torch.cuda, "_is_compiled", None)
    return bool(check()) if check is not None else torch.backends.cuda.is_built()


def device_count_nvml() -> int:
    """GPUs NVML counts (-1 when it cannot), without starting CUDA."""
    import torch

    count = getattr(torch.cuda, "_device_count_nvml", None)
    return count() if count is not None else -1


# Both take the torch.cuda module: cuda_origin wraps it right after its import, while
# torch itself may still be importing.
def lazy_init(cuda: ModuleType) -> Callable[..., Any]:
    """torch's function that starts CUDA."""
    if not hasattr(cuda, LAZY_INIT):
        raise missing_error("torch.cuda._lazy_init", "Keeping the kernel free of CUDA")
    return getattr(cuda, LAZY_INIT)


def replace_lazy_init(cuda: ModuleType, function: Callable[..., Any]) -> None:
    """Make `function` the one through which torch starts CUDA."""
    setattr(cuda, LAZY_INIT, function)


def _present(name: str) -> bool:
    import torch

    return has(torch.cuda, name)


APIS = [
    PrivateApi(
        "torch.cuda._lazy_init",
        "stopping and naming the code that would start CUDA in the kernel before a fork",
        "refused: GPU launches say which torch they need",
        lambda: _present(LAZY_INIT),
    ),
    PrivateApi(
        "torch.cuda._device_count_nvml",
        "counting GPUs without starting CUDA where NVML alone can (MIG)",
        "the GPUs are counted from CUDA_VISIBLE_DEVICES or NVML itself",
        lambda: _present("_device_count_nvml"),
    ),
    PrivateApi(
        "torch.cuda._is_compiled",
        "telling a CPU build of torch from a CUDA one without starting CUDA",
        "torch.backends.cuda.is_built()",
        lambda: _present("_is_compiled"),
    ),
]
