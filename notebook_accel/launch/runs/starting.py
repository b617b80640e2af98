"""Starting a detached run from the kernel: ship the launch, start its keeper.

`start_keeper` writes nothing itself: `write_plan` puts the run's function,
arguments and checked options into the run directory first (the function by
value, so a notebook cell's function works, as in fresh workers). The keeper
is a fresh interpreter that forks once more and lets its first process exit,
so it is nobody's child: the kernel does not wait for it, and a kernel that
dies or restarts does not take it along (it runs in a session of its own, out
of the kernel's process group). keeper.py is what it runs.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import cloudpickle
import psutil

from notebook_accel.launch.packing import pack, unpack
from notebook_accel.launch.processes import start_detached
from notebook_accel.launch.runs.directory import (
    KEEPER_LOG,
    PLAN_FILE,
    RunDirectory,
    open_private,
    write_private,
)

# How long the kernel waits for the keeper's first process to hand over (it only forks).
HANDOVER_SECONDS = 60.0
# What the keeper runs (launch/runs/keeper.py).
_KEEPER = "notebook_accel.launch.runs.keeper:keeper_main"


def plan_bytes(plan: Any) -> bytes:
    """The launch, as a keeper will run it: the function and its arguments by value (a
    notebook cell's function works, as in fresh workers), the options as checked."""
    shipped = pack(plan.function, plan.args, plan.kwargs)
    options = dataclasses.replace(plan, function=None, args=(), kwargs={})
    return pickle.dumps((cloudpickle.dumps(options, protocol=5), shipped))


def plan_from_bytes(data: bytes) -> Any:
    """The plan `plan_bytes` packed, its function and arguments unpacked."""
    options, shipped = pickle.loads(data)
    plan = cloudpickle.loads(options)
    function, args, kwargs = unpack(shipped)
    return dataclasses.replace(plan, function=function, args=args, kwargs=kwargs)


def write_plan(directory: RunDirectory, plan: Any) -> None:
    """The launch (`plan_bytes`) into the run directory, for its keeper and `resume`."""
    write_private(directory.path / PLAN_FILE, plan_bytes(plan))


def read_plan(directory: RunDirectory) -> Any:
    """The plan `write_plan` wrote, its function and arguments unpacked."""
    return plan_from_bytes((directory.path / PLAN_FILE).read_bytes())


def start_keeper(directory: RunDirectory) -> None:
    """Start the run's keeper (its plan written already) and record its PID.

    Returns once the keeper runs, before it imports torch: the run starts while
    the kernel goes on. Raises RuntimeError, with the keeper's words, if it
    could not start.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    with os.fdopen(open_private(directory.path / KEEPER_LOG, flags), "ab") as log:
        pid = start_detached(_KEEPER, [str(directory.path)], log, HANDOVER_SECONDS)
    if pid is None:
        directory.update(state="lost", error="the keeper did not start")
        raise RuntimeError(
            "the detached run's keeper process did not start:\n" + directory.keeper_log_tail()
        )
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:  # it ended already: its log says why
        started = None
    directory.update(keeper_pid=pid, keeper_started=started)
