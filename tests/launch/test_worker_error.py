"""A failed launch's WorkerError is also torch's ChildFailedError, as Accelerate's launcher raises.

Code written for Accelerate catches `ChildFailedError`; it must catch ours,
and still see our message and fields.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from notebook_accel import WorkerError, notebook_launcher
from notebook_accel.launch.errors import WorkerFailure


def rank1_raises():
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch shape")


def test_except_child_failed_error_catches_a_failed_launch_with_our_message_and_fields():
    try:
        notebook_launcher(rank1_raises, num_processes=2, backend="cpu", timeout=60)
    except ChildFailedError as caught:
        error = caught
    assert isinstance(error, WorkerError) and isinstance(error, RuntimeError)
    assert str(error).startswith("worker rank 1 raised ValueError: bad batch shape")
    assert error.rank == 1 and error.exitcode == 1
    assert "ValueError: bad batch shape" in error.traceback
    assert error.failures[0].rank == 1
    # ChildFailedError's own API answers from the same failure.
    rank, failure = error.get_first_failure()
    assert rank == 1 and failure is error.failures[0]
    assert error.format_msg() == str(error)
    assert error.name == "notebook_launcher"


def test_it_survives_pickling_as_both():
    error = WorkerError([WorkerFailure(0, -9), WorkerFailure(1, 1, "Traceback", "OSError: x")])
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, ChildFailedError) and str(again) == str(error)
    assert again.rank == 0 and len(again.failures) == 2


def test_importing_the_error_alone_does_not_start_anything_else():
    # torch.distributed.elastic.multiprocessing comes with ChildFailedError; it must
    # not start threads or change signal handlers in the kernel that imports it.
    code = (
        "import signal, threading, sys\n"
        "watched = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)\n"
        "before = {s: signal.getsignal(s) for s in watched}\n"
        "import notebook_accel.launch.errors\n"
        "after = {s: signal.getsignal(s) for s in before}\n"
        "sys.exit(int(before != after or threading.active_count() != 1))\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
