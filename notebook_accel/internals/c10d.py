"""The default process group's store and timeout, for forming the group again
(notebook_accel/live/regroup.py): torch has no public getter for either."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from notebook_accel.internals.api import PrivateApi, has, missing_error


def default_store() -> Any:
    """The store the default process group met at."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise missing_error(
            "distributed_c10d._get_default_store", "Forming live workers' group again"
        )
    return getter()


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout `group` was made with; None where torch does not tell (the new group
    then takes torch's default)."""
    for device in getattr(group, "_device_types", ()):
        with contextlib.suppress(Exception):
            return group._get_backend(device).options._timeout
    return None


APIS = [
    PrivateApi(
        "distributed_c10d._get_default_store",
        "forming live workers' process group again",
        "the group cannot be formed again: the workers are restarted",
        lambda: has(dist.distributed_c10d, "_get_default_store"),
    ),
    PrivateApi(
        "ProcessGroup._device_types, _get_backend(device).options._timeout",
        "keeping the timeout of a live workers' group formed again",
        "the group formed again has torch's default timeout",
        lambda: has(dist.ProcessGroup, "_device_types", "_get_backend"),
    ),
]
