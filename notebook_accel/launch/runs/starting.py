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
import json
import os
import pickle
import subprocess
import sys
from typing import Any

import cloudpickle
import psutil

from notebook_accel.launch.packing import pack, unpack
from notebook_accel.launch.runs.directory import (
    KEEPER_LOG,
    PLAN_FILE,
    RunDirectory,
    open_private,
    write_private,
)

# How long the kernel waits for the keeper's first process to hand over (it only forks).
HANDOVER_SECONDS = 60.0

# Runs in the new interpreter: fork the keeper, say its PID, and let this process end.
_BOOTSTRAP = """\
import json, os, signal, sys
sys.path[:] = json.loads(sys.argv[1])
# A stop that comes while the keeper imports (seconds) is kept for when it can act on it.
stops = []
signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
signal.signal(signal.SIGTERM, lambda signum, frame: stops.append(signum))
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.dup2(2, 1)  # the keeper's output goes to its log; the kernel's pipe closes
from notebook_accel.launch.runs.keeper import keeper_main
keeper_main(sys.argv[2], stops)
"""


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
    log = os.fdopen(open_private(directory.path / KEEPER_LOG, flags), "ab")
    try:
        first = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(directory.path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            cwd=os.getcwd(),
        )
    finally:
        log.close()
    try:
        said, _ = first.communicate(timeout=HANDOVER_SECONDS)
    except subprocess.TimeoutExpired:
        first.kill()
        first.wait()
        said = b""
    pid = said.strip()
    if first.returncode != 0 or not pid.isdigit():
        directory.update(state="lost", error="the keeper did not start")
        raise RuntimeError(
            "the detached run's keeper process did not start:\n" + directory.keeper_log_tail()
        )
    try:
        started = psutil.Process(int(pid)).create_time()
    except psutil.Error:  # it ended already: its log says why
        started = None
    directory.update(keeper_pid=int(pid), keeper_started=started)
