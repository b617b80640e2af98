"""A run that makes no progress is explained in the cell: each rank's collective and line.

Real 2-worker gloo runs for the classic hangs (a rank skips a collective and blocks on a
lock, ranks call collectives in another order, one rank has one more batch), Stop
pressed on a stuck run, a busy run that is never reported; and the parsing of
faulthandler's dumps.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.launch.options import HANG_AFTER_SECONDS, OPTIONS
from notebook_accel.launch.stacks import Frame, StackCapture, explain

HERE = os.path.basename(__file__)


def different_order():
    rank = Accelerator().process_index
    x, y = torch.ones(3), torch.ones(3)
    if rank == 0:
        dist.all_reduce(x)
        dist.broadcast(y, 0)
    else:
        dist.broadcast(y, 0)
        dist.all_reduce(x)


def one_more_batch():
    accelerator = Accelerator()
    for _ in range(3 if accelerator.process_index == 0 else 2):
        dist.all_reduce(torch.ones(4))
    accelerator.wait_for_everyone()


def blocked_on_a_lock():
    rank = Accelerator().process_index
    lock = threading.Lock()
    lock.acquire()
    if rank == 1:
        lock.acquire()  # never given back: rank 1 never reaches the all_reduce
    dist.all_reduce(torch.ones(2))


def _stuck_run(function, capfd, **options) -> tuple[type, str]:
    options = {"explain_hang_after": 1.5, "timeout": 8, **options}
    with pytest.raises((TimeoutError, KeyboardInterrupt)) as raised:
        notebook_launcher(function, backend="cpu", **{"num_processes": 2, **options})
    return raised.type, capfd.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("function", "expected"),
    [
        (
            different_order,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from different_order",
                "rank 1: waits in torch.distributed.broadcast, called from different_order",
                "The ranks wait in different collectives (rank 0 in all_reduce; rank 1 in "
                "broadcast): they call collectives in a different order",
            ],
        ),
        (
            one_more_batch,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from one_more_batch",
                "rank 1: waits in torch.distributed.barrier, called from one_more_batch",
                "or one calls one more (a longer loop, an extra batch)",
            ],
        ),
        (
            blocked_on_a_lock,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from blocked_on_a_lock",
                "rank 1: not in a collective, at blocked_on_a_lock",
                "Rank 0 wait(s) in all_reduce for rank 1.",
            ],
        ),
    ],
)
def test_a_stalled_run_shows_where_each_rank_is_and_goes_on(function, expected, capfd):
    kind, err = _stuck_run(function, capfd)
    assert kind is TimeoutError  # shown, then the run went on until its timeout
    assert err.count("no progress for 1.5 s") == 1  # once per stall
    for line in expected:
        assert line in err, err
    # each rank's stack, innermost first, the cell's (here the test file's) lines marked,
    # the launcher's own frames left out; faulthandler's raw dump not echoed as output
    assert "rank 0's stack, innermost first:\n" in err
    assert f"-> {__file__}" in err
    assert "worker_main" not in err and "(most recent call first)" not in err
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in err


def one_rank_skips_an_all_reduce():
    accelerator = Accelerator()
    if accelerator.process_index != 2:  # rank 2 skips it and goes on to the next one
        dist.all_reduce(torch.ones(2))
    accelerator.wait_for_everyone()


@pytest.mark.timeout(60)
def test_on_three_workers_the_rank_that_skipped_a_collective_is_named(capfd):
    kind, err = _stuck_run(one_rank_skips_an_all_reduce, capfd, num_processes=3)
    assert kind is TimeoutError
    for line in [
        "rank 0: waits in torch.distributed.all_reduce, called from one_rank_skips_an_all_reduce",
        "rank 1: waits in torch.distributed.all_reduce, called from one_rank_skips_an_all_reduce",
        "rank 2: waits in torch.distributed.barrier, called from one_rank_skips_an_all_reduce",
        "they call collectives in a different order, or one calls one more",
    ]:
        assert line in err, err


@pytest.mark.timeout(60)
def test_stop_pressed_on_a_stuck_run_shows_where_it_was(capfd):
    # what the notebook's Stop button does: SIGINT to the kernel
    timer = threading.Timer(6.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        kind, err = _stuck_run(blocked_on_a_lock, capfd, explain_hang_after=None, timeout=30)
    finally:
        timer.cancel()
    assert kind is KeyboardInterrupt
    assert "Stop pressed after 6 s without progress; before the workers are stopped" in err
    assert "rank 1: not in a collective, at blocked_on_a_lock" in err
    assert "no progress for" not in err  # explain_hang_after=None: not before the Stop


def busy():
    for step in range(6):
        time.sleep(0.4)
        print(f"step {step}", flush=True)
    return "done"


@pytest.mark.timeout(60)
def test_a_run_that_makes_progress_is_never_reported(capfd):
    assert notebook_launcher(busy, num_processes=2, backend="cpu", explain_hang_after=1) == "done"
    assert "Where each rank is" not in capfd.readouterr().err


def test_the_option_has_a_default_and_refuses_nonsense():
    option = OPTIONS["explain_hang_after"]
    assert option.default == HANG_AFTER_SECONDS == 120.0
    assert option.check(None) is None and option.check(30) == 30.0
    for bad in (0, -1, "soon", True):
        with pytest.raises(ValueError, match="explain_hang_after=.* must be a positive number"):
            option.check(bad)


DUMP = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_1/123.py", line 5 in train
  File "/x/notebook_accel/platforms/base.py", line 179 in run_in_worker
  File "/x/notebook_accel/launch/worker.py", line 249 in _call_user_function
  File "/x/notebook_accel/launch/worker.py", line 163 in worker_main
  File "/tmp/ipykernel_1/999.py", line 1 in <module>
"""


def test_a_dump_is_read_out_of_the_worker_s_stderr_and_nothing_else():
    capture = StackCapture()
    assert not capture.take("Thread 0x1 (most recent call first):\n")  # not asked for
    capture.expect()
    taken = [capture.take(line) for line in DUMP.splitlines(keepends=True)]
    assert all(taken)
    assert not capture.take("the user's own line\n")
    frames = capture.finish()  # the worker's thread, without the launcher's frames
    assert [f.function for f in frames] == ["all_reduce", "wrapper", "train", "run_in_worker"]
    text = explain("stuck", {0: frames}, {1: "finished (exited with code 0)"})
    assert "rank 0: waits in torch.distributed.all_reduce, called from train" in text
    assert "rank 1: finished (exited with code 0)" in text
    assert "Rank 0 wait(s) in all_reduce for rank 1." in text
    assert "  -> /tmp/ipykernel_1/123.py, line 5, in train" in text
    assert explain("stuck", {0: []}, {}).count("did not answer") == 1
    assert Frame("/x/notebook_accel/launch/worker.py", 1, "f").in_libraries
