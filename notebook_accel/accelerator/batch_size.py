"""Find the largest batch size that fits: retry a training function with a smaller batch.

`find_executable_batch_size` (Accelerate's `accelerate.utils` name) calls the
decorated function with a batch size as its first argument; when the call runs
out of device memory it frees what the failed try held and calls again with
0.9 times the batch (rounded down, as Accelerate does), down to 1.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

# The messages device allocators raise as a plain RuntimeError when memory runs out.
OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, HIP, XPU and CPU ("CPU out of memory.")
    "CUDA error: out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's way of saying it, for large batches
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Gaudi (HPU)
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` says the device ran out of memory (a smaller batch may fit)."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(message in str(exception.args[0]) for message in OUT_OF_MEMORY_MESSAGES)
    return False


def release_memory(*objects: Any) -> list[None]:
    """Drop the references in `objects`, collect garbage, empty the device's cache.

    Use as `a, b = release_memory(a, b)`: the names then hold None.
    """
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    clear_device_cache()
    return objects


def clear_device_cache(garbage_collection: bool = True) -> None:
    """Collect garbage (what a failed try left), then give cached device memory back."""
    if garbage_collection:
        gc.collect()
    from notebook_accel.training.state import PartialState

    if "platform_name" in PartialState._shared_state:  # the process's platform is known: ask it
        PartialState().platform.empty_cache()
    elif torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Decorator: call `function(batch_size, ...)`, shrinking `batch_size` after each
    out-of-memory.

    The decorated function is called without its first argument, which is
    filled in: `starting_batch_size` first, then `int(0.9 * batch_size)` after each
    out-of-memory error (`torch.OutOfMemoryError`, or the allocators' messages
    in `OUT_OF_MEMORY_MESSAGES`), or whatever `reduce_batch_size_fn()` returns.
    Between tries garbage is collected and the device cache emptied, so the
    next try has the failed one's memory. Other errors pass through. A call gives
    up with a RuntimeError when the batch size reaches 0 (at once for a
    `starting_batch_size` of 0).
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if int(starting_batch_size) < 0:
        raise ValueError(f"starting_batch_size={starting_batch_size} must be 1 or more.")

    def shrink(size: int) -> int:
        return int(size * 0.9)

    reduce = (lambda size: reduce_batch_size_fn()) if reduce_batch_size_fn else shrink

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        parameters = list(inspect.signature(function).parameters)
        if len(parameters) < len(args) + 1:
            raise TypeError(
                f"{function.__name__}() gets its batch size as its first argument from "
                "find_executable_batch_size; call it without it (it was called with "
                f"{len(args)} positional argument(s) for {len(parameters) - 1} more parameter(s))."
            )
        batch_size = int(starting_batch_size)
        clear_device_cache()
        while True:
            if batch_size <= 0:
                # Accelerate's words first (code matches on them), then what to do.
                raise RuntimeError(
                    "No executable batch size found, reached zero. "
                    + (
                        "Even a batch of 1 ran out of memory: use a smaller model, mixed "
                        "precision or more processes."
                        if batch_size != int(starting_batch_size)
                        else "Give find_executable_batch_size a starting_batch_size of 1 or more."
                    )
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - sorted just below
                if not should_reduce_batch_size(error):
                    raise
            # Out of the except block: the error and its frames (holding the failed
            # try's tensors) are gone before the cache is emptied.
            clear_device_cache()
            batch_size = reduce(batch_size)

    return decorator


__all__ = [
    "OUT_OF_MEMORY_MESSAGES",
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]
