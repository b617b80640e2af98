"""Metric records: made in a worker by `Accelerator.log`, collected in the kernel.

A record goes where this process's metrics go (reporting/destination.py): in a
launched worker, down the worker's channel to the launching process, which
keeps the run's history and draws it live; in an in-process launch
(`num_processes=1`), straight into the run's report. Anywhere else it is kept
in `local_history()`, which holds the newest LOCAL_HISTORY_MAXLEN records.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from notebook_accel.config.settings import process_rank_and_world
from notebook_accel.reporting.destination import current as current_destination
from notebook_accel.reporting.events import MetricRecord

# Records logged outside any launch are kept up to this many; older ones are dropped,
# so a long session that logs without launching does not grow without bound.
LOCAL_HISTORY_MAXLEN = 10_000

_local_history: deque[MetricRecord] = deque(maxlen=LOCAL_HISTORY_MAXLEN)


def local_history() -> list[MetricRecord]:
    """Records logged in this process while no launch was collecting them, oldest first.

    Only the newest LOCAL_HISTORY_MAXLEN are kept.
    """
    return list(_local_history)


def clear_local_history() -> None:
    """Forget the records `local_history()` holds."""
    _local_history.clear()


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
    send = current_destination().metric
    if send is not None:
        send(entry)
    else:
        _local_history.append(entry)
    return entry


def is_shown(value: Any) -> bool:
    """Whether the live view can show `value`: a number, a one-element tensor or a string."""
    if hasattr(value, "numel") and callable(value.numel) and value.numel() != 1:
        return False
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    return isinstance(value, (numbers.Real, str))


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


__all__ = [
    "MetricRecord",
    "LOCAL_HISTORY_MAXLEN",
    "clear_local_history",
    "is_shown",
    "local_history",
    "record",
]
