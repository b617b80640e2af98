"""Metric records: made in a worker by `Accelerator.log`, collected in the kernel.

In a launched worker a record goes straight down the worker's channel to the
launching process, which keeps the run's history and draws it live. Anywhere
else (one process, `num_processes=1`) it goes to the local sink the launcher
sets, or is kept in `local_history()`.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from notebook_accel.config import process_rank_and_world
from notebook_accel.launch.channel import worker_channel


@dataclass(frozen=True)
class MetricRecord:
    """One `log()` call: the values one rank reported at one step."""

    step: int | None
    rank: int
    values: dict[str, float | str]
    time: float


_local_sink: Callable[[MetricRecord], None] | None = None
_local_history: list[MetricRecord] = []


def set_local_sink(sink: Callable[[MetricRecord], None] | None):
    """Send records made in this process to `sink`; returns the previous sink."""
    global _local_sink
    previous, _local_sink = _local_sink, sink
    return previous


def local_history() -> list[MetricRecord]:
    """Records logged in this process while no launch was collecting them."""
    return _local_history


def record(values: Mapping[str, Any], step: int | None = None) -> MetricRecord:
    """Make a record of `values` and send it where this process's metrics go."""
    if not isinstance(values, Mapping):
        raise TypeError(f"log() takes a dict of metric names to values, got {values!r}.")
    entry = MetricRecord(
        step=None if step is None else int(step),
        rank=process_rank_and_world()[0],
        values={str(name): _plain(name, value) for name, value in values.items()},
        time=time.time(),
    )
    channel = worker_channel()
    if channel is not None:
        channel.send("metric", entry, batch=True)
    elif _local_sink is not None:
        _local_sink(entry)
    else:
        _local_history.append(entry)
    return entry


def _plain(name: str, value: Any) -> float | str:
    if hasattr(value, "item") and callable(value.item):  # tensors and numpy scalars
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return value
    raise TypeError(
        f"log() got {type(value).__name__} for {name!r}; log numbers, one-element "
        "tensors or strings."
    )
