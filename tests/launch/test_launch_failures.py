"""A failing worker becomes one WorkerError; the others are stopped fast; nothing leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from notebook_accel import WorkerError, last_run, notebook_launcher
from tests_support import EACH_START, PROMPTLY, SHIPPED, live_children

# A worker's death, exit and stop depend on how its process was started and is watched:
# those tests run under every start method (EACH_START); a result that cannot travel
# back fails in code a worker runs once started (SHIPPED).


def rank() -> int:
    return int(os.environ["RANK"])


def stamp(path):
    with open(path, "w") as file:
        file.write(repr(time.time()))


def rank1_raises(stamp_path):
    dist.init_process_group("gloo")
    if rank() == 1:
        stamp(stamp_path)
        raise ValueError("bad batch shape")
    dist.barrier()  # rank 0 waits here for a peer that will never come
    time.sleep(600)


@EACH_START
def test_a_raising_rank_surfaces_with_its_traceback_and_the_rest_stop_fast(tmp_path):
    path = tmp_path / "failed_at"
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(rank1_raises, args=(str(path),), num_processes=2, backend="cpu")
    returned_at = time.time()
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert error.rank == 1 and error.exitcode == 1
    assert "ValueError: bad batch shape" in error.traceback
    assert "in rank1_raises" in error.traceback
    assert "worker rank 1 raised ValueError: bad batch shape" in str(error)
    assert returned_at - float(path.read_text()) < PROMPTLY  # rank 0 sleeps for 600 s
    assert live_children() == []
    assert last_run().status == "failed"


class SlowFlush:
    """A stream whose flush takes a second, as a tee to a slow disk's log file may: the
    worker flushes its streams after sending its error, before it exits."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(text)

    def flush(self):
        time.sleep(1.0)
        self.stream.flush()


def rank1_raises_then_exits_slowly():
    dist.init_process_group("gloo")
    if rank() == 1:
        sys.stdout = SlowFlush(sys.stdout)
        raise ValueError("bad batch shape")
    dist.barrier()
    time.sleep(600)


@SHIPPED
def test_a_raising_rank_s_exit_code_is_in_its_worker_error_when_its_exit_is_slow():
    # On a loaded machine a worker can take longer to exit after its error than the
    # launcher listens for more failures; the error still says how the worker ended.
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(rank1_raises_then_exits_slowly, num_processes=2, backend="cpu")
    assert (caught.value.rank, caught.value.exitcode) == (1, 1)
    assert live_children() == []


def rank1_killed(stamp_path):
    dist.init_process_group("gloo")
    dist.barrier()
    if rank() == 1:
        stamp(stamp_path)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


@EACH_START
def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    path = tmp_path / "killed_at"
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(rank1_killed, args=(str(path),), num_processes=2, backend="cpu")
    assert time.time() - float(path.read_text()) < PROMPTLY  # rank 0 sleeps for 600 s
    error = caught.value
    assert error.rank == 1 and error.exitcode == -signal.SIGKILL
    assert "killed by SIGKILL" in str(error)
    assert live_children() == []


def rank0_exits(code):
    if rank() == 0:
        sys.stdout.flush()
        os._exit(code)
    time.sleep(600)


@EACH_START
def test_a_nonzero_exit_is_named_with_its_code():
    with pytest.raises(WorkerError, match="worker rank 0 exited with code 3") as caught:
        notebook_launcher(rank0_exits, args=(3,), num_processes=2, backend="cpu")
    assert caught.value.exitcode == 3 and caught.value.traceback == ""


def sys_exit_on_rank1():
    if rank() == 1:
        sys.exit(4)
    time.sleep(600)


@EACH_START
def test_sys_exit_with_a_code_is_a_failure():
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(sys_exit_on_rank1, num_processes=2, backend="cpu")
    assert caught.value.rank == 1 and caught.value.exitcode == 4


def dies_before_rendezvous():
    if rank() == 1:
        raise RuntimeError("could not load data")
    dist.init_process_group("gloo")  # alone, this would wait for rank 1 forever
    return "unreachable"


@EACH_START
def test_a_rank_dying_before_the_rendezvous_does_not_leave_the_others_waiting():
    started = time.monotonic()
    with pytest.raises(WorkerError, match="could not load data"):
        notebook_launcher(dies_before_rendezvous, num_processes=2, backend="cpu")
    assert time.monotonic() - started < PROMPTLY  # not the rendezvous's own timeout
    assert live_children() == []


def spawns_grandchild_then_fails(folder):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record_process(folder, child.pid)
    if rank() == 1:
        # Fail only once rank 0 has its own child too: fresh interpreters start at
        # different speeds, and a rank 0 stopped before its Popen has nothing to stop.
        wait_for_records(folder, count=2)
        raise OSError("disk full")  # its child is re-parented, out of this test's sight
    time.sleep(600)


def record_process(folder, pid):
    """Note a process a worker started, with its start time (pids are reused)."""
    import psutil

    with open(os.path.join(folder, f"{pid}.pid"), "w") as file:
        file.write(repr(psutil.Process(pid).create_time()))


def wait_for_records(folder, count, seconds=60.0):
    deadline = time.monotonic() + seconds
    while sum(name.endswith(".pid") for name in os.listdir(folder)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of the {count} workers recorded a child")
        time.sleep(0.02)


def recorded_processes_still_running(folder, seconds=5.0):
    """The processes `record_process` noted that are still running after `seconds`."""
    import psutil

    recorded = {
        int(name.split(".")[0]): float(open(os.path.join(folder, name)).read())
        for name in os.listdir(folder)
        if name.endswith(".pid")
    }
    deadline = time.monotonic() + seconds
    while True:
        running = []
        for pid, created in recorded.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.Error:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


@EACH_START
def test_processes_started_by_workers_are_stopped_too(tmp_path):
    with pytest.raises(WorkerError, match="disk full"):
        notebook_launcher(
            spawns_grandchild_then_fails, args=(str(tmp_path),), num_processes=2, backend="cpu"
        )
    assert len(list(tmp_path.glob("*.pid"))) == 2  # both workers started one
    assert recorded_processes_still_running(tmp_path, seconds=3) == []
    assert live_children() == []


def returns_a_generator():
    return (i for i in range(3))


@SHIPPED
def test_a_result_that_cannot_travel_back_is_a_clear_worker_error():
    with pytest.raises(WorkerError, match="cannot be sent back to the notebook"):
        notebook_launcher(returns_a_generator, num_processes=2, backend="cpu")


def sleeps(seconds):
    time.sleep(seconds)


@EACH_START
def test_timeout_stops_the_run_and_raises_timeout_error():
    # The workers sleep for 600 s, past this test's own time limit: only a run the
    # timeout stopped lets the test end (however long a loaded machine takes to start it).
    with pytest.raises(TimeoutError, match="timeout=1.0"):
        notebook_launcher(sleeps, args=(600,), num_processes=2, timeout=1.0, backend="cpu")
    assert live_children() == []
    assert last_run().status == "timed out"
    assert notebook_launcher(sleeps, args=(0,), num_processes=2, backend="cpu") is None


LAUNCHER_SCRIPT = """
import os, subprocess, sys, time
from notebook_accel import notebook_launcher

def starts_a_child_and_waits(folder):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    for pid in (os.getpid(), child.pid):
        open(os.path.join(folder, f"{pid}.started"), "w").close()
    time.sleep(600)

notebook_launcher(starts_a_child_and_waits, args=(sys.argv[1],), num_processes=2,
                  backend="cpu", live=False)
"""


@EACH_START
def test_killing_the_launcher_ends_the_workers_and_what_they_started(tmp_path):
    import psutil

    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER_SCRIPT)
    folder = tmp_path / "pids"
    folder.mkdir()
    launcher = subprocess.Popen([sys.executable, str(script), str(folder)])
    try:
        deadline = time.monotonic() + 60
        while len(list(folder.glob("*.started"))) < 4:  # 2 workers, 1 child each
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        # Everything the launch started: workers, their children, the janitor.
        started = psutil.Process(launcher.pid).children(recursive=True)
        assert len(started) >= 5
        launcher.kill()  # as a kernel restart does: no chance to clean up
        launcher.wait(10)
        gone, alive = psutil.wait_procs(started, timeout=5)
        assert alive == [], [(p.pid, p.cmdline()) for p in alive]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


CRASHING_SCRIPT = """
import faulthandler, signal
from notebook_accel import WorkerError, notebook_launcher

faulthandler.enable()  # as pytest and Jupyter kernels do
# ...and then a library puts its own crash handler in place (Ray does in ray.init)
signal.signal(signal.SIGSEGV, signal.SIG_DFL)

def rank1_crashes_in_c():
    import ctypes, os, time
    if os.environ["RANK"] == "1":
        ctypes.string_at(0)
    time.sleep(600)

try:
    notebook_launcher(rank1_crashes_in_c, num_processes=2, backend="cpu", live=False)
except WorkerError as error:
    assert error.rank == 1 and error.exitcode == -signal.SIGSEGV, str(error)
    print(error.traceback)
"""


@EACH_START
def test_a_crashed_rank_s_python_stack_is_in_its_worker_error(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stack = done.stdout
    assert stack.startswith("Fatal Python error: Segmentation fault"), done.stdout + done.stderr
    assert "line 12 in rank1_crashes_in_c" in stack
    assert "Extension modules" not in stack
