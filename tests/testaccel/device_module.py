"""The device module of "testaccel" (registered as `torch.testaccel`): what torch and
libraries ask of an accelerator's module, in the shape of `torch.cuda`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

DEVICE_TYPE = "testaccel"
DEVICE_NAME = "Test accelerator"


def _ops():
    return torch.ops.testaccel


def _index(device: Any = None, *, optional: bool = True) -> int:
    """A device index from an int, a string, a torch.device or None (the current one)."""
    if device is None or (isinstance(device, int) and device < 0 and optional):
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != DEVICE_TYPE:
            raise ValueError(f"expected a {DEVICE_TYPE} device, got {device}")
        return current_device() if device.index is None else device.index
    return int(device)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    """Whether this process has used a device (allocated or set one) since it started,
    or since it was forked."""
    return bool(_ops().is_initialized())


def _lazy_init() -> None:
    """Nothing to initialize: the devices exist once the extension is loaded."""


def _is_in_bad_fork() -> bool:
    """Whether this process was forked from one that had used a device: then it cannot."""
    return bool(_ops().is_in_bad_fork())


def init() -> None:
    _lazy_init()


def device_count() -> int:
    return int(_ops().device_count())


def current_device() -> int:
    return int(_ops().current_device())


def set_device(device: Any) -> None:
    index = _index(device, optional=False) if device is not None else -1
    if index >= 0:
        _ops().set_device(index)


class device:  # noqa: N801 (named as torch.cuda.device)
    """Context manager that makes `device` the current device, and restores the one
    before it on exit."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.index >= 0:
            set_device(self.index)

    def __exit__(self, *exc_info: object) -> None:
        set_device(self.previous)


def synchronize(device: Any = None) -> None:
    """Every kernel has finished when it returns: nothing to wait for."""
    _index(device)


def get_device_name(device: Any = None) -> str:
    _index(device)
    return DEVICE_NAME


def get_device_capability(device: Any = None) -> tuple[int, int]:
    _index(device)
    return (1, 0)


@dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    index: int
    type: str = DEVICE_TYPE
    multi_processor_count: int = 1
    major: int = 1
    minor: int = 0


def get_device_properties(device: Any = None) -> DeviceProperties:
    index = _index(device)
    return DeviceProperties(name=DEVICE_NAME, total_memory=_stats(index)[6], index=index)


# Random numbers: one default generator per device.


def default_generator(device: Any = None) -> torch.Generator:
    return _ops().default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        default_generator(index).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    random_seed = default_generator(0).seed()
    for index in range(1, device_count()):
        default_generator(index).manual_seed(random_seed)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: Any = DEVICE_TYPE) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = DEVICE_TYPE) -> None:
    default_generator(device).set_state(new_state.clone())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


# Mixed precision: bfloat16 only.


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# Streams and events: they complete at once.


class Stream(torch.Stream):
    """A stream of a testaccel device (the current one when none is given)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if "stream_id" in kwargs:
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(
            cls, device=torch.device(DEVICE_TYPE, _index(device)), priority=priority
        )


class Event(torch.Event):
    """An event of a testaccel device (the current one when none is given)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, **kwargs: Any):
        device = kwargs.pop("device", None)
        kwargs.pop("interprocess", None)
        return super().__new__(
            cls,
            device=torch.device(DEVICE_TYPE, _index(device)),
            enable_timing=enable_timing,
            blocking=blocking,
        )


def current_stream(device: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device(DEVICE_TYPE, _index(device)))


def default_stream(device: Any = None) -> torch.Stream:
    # Stream id 0 is the default stream; 20 is c10::DeviceType::PrivateUse1.
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=20)


def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    """Context manager that makes `stream` current on its device, and restores the
    stream before it on exit (None: no change)."""
    if stream is None:
        yield
        return
    previous = current_stream(stream.device_index)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


# Memory.


def _stats(device: Any = None) -> list[int]:
    return list(_ops().memory_stats(_index(device)))


def memory_allocated(device: Any = None) -> int:
    return _stats(device)[0]


def max_memory_allocated(device: Any = None) -> int:
    return _stats(device)[1]


def memory_reserved(device: Any = None) -> int:
    return _stats(device)[2]


def max_memory_reserved(device: Any = None) -> int:
    return _stats(device)[3]


def reset_peak_memory_stats(device: Any = None) -> None:
    _ops().reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _ops().reset_accumulated_memory_stats(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: total is the nominal memory of a device, free what is
    not allocated of it."""
    stats = _stats(device)
    total = stats[6]
    return max(total - stats[2], 0), total


def memory_stats(device: Any = None) -> dict[str, int]:
    allocated, peak, reserved, reserved_peak, allocs, frees, _ = _stats(device)
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": reserved_peak,
        "active_bytes.all.current": allocated,
        "active_bytes.all.peak": peak,
        "allocation.all.allocated": allocs,
        "allocation.all.freed": frees,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def empty_cache() -> None:
    """Memory goes back to the host as soon as it is freed: no cache to empty."""
