"""How context parallelism passes keys and values between ranks (ParallelismConfig's
cp_comm_strategy, which Accelerate sets the same way): torch sets it only through its
private module torch.distributed.tensor.experimental._attention, still private in
torch 2.14."""

from __future__ import annotations

from typing import Any

from notebook_accel.internals.api import PrivateApi, has, missing_error

_API = "tensor.experimental._attention.set_rotate_method"
_NEEDED_FOR = "ParallelismConfig's cp_comm_strategy"
# torch's _RotateMethod members by the strategy names it takes
_STRATEGIES = {"ALL_GATHER": "allgather", "ALL_TO_ALL": "alltoall"}


def set_rotate_method(strategy: str) -> None:
    """Make torch's context parallelism use `strategy` ("allgather" or "alltoall") from
    now on, in this process."""
    require_rotate_method(_NEEDED_FOR)
    _attention().set_rotate_method(strategy)


def rotate_method() -> str:
    """The strategy torch's context parallelism uses now in this process."""
    require_rotate_method(_NEEDED_FOR)
    return _STRATEGIES[_attention()._cp_options.rotate_method.name]


def require_rotate_method(needed_for: str) -> None:
    """Raise TorchInternalMissing, before anything starts, where this torch cannot be
    told how to rotate."""
    if not _present():
        raise missing_error(_API, needed_for)


def _attention() -> Any:
    from torch.distributed.tensor.experimental import _attention

    return _attention


def _present() -> bool:
    try:
        module = _attention()
    except ImportError:
        return False
    options = getattr(module, "_cp_options", None)
    return has(module, "set_rotate_method") and has(options, "rotate_method")


APIS = [
    PrivateApi(
        _API,
        "ParallelismConfig's cp_comm_strategy (how context parallelism passes keys and values)",
        "a ParallelismConfig with cp_size > 1 is refused before anything starts",
        _present,
    )
]
