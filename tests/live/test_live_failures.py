"""What notebook users do to live workers that used to end the group or hide the cause:
a value that cannot come back, a worker that dies between calls. 2 CPU workers each time."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import notebook_accel.live as live
from notebook_accel import WorkerError
from notebook_accel.live import start_workers


@pytest.fixture
def workers():
    group = start_workers(2, backend="cpu", live=False)
    yield group
    group.close()


DDP_CELL = """
import torch
from notebook_accel import Accelerator

torch.manual_seed(0)
accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(16, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
steps = 0

def train_step():
    global steps
    loss = model(data).square().mean()
    accelerator.backward(loss)  # DDP's all-reduce
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    return steps
"""

SAME_WEIGHTS = "accelerator.unwrap_model(model).weight.detach()"


def assert_replicas_equal(workers):
    weights = workers.run_cell(SAME_WEIGHTS, return_all=True)
    assert torch.equal(weights[0], weights[1])


# -- values that cannot come back ---------------------------------------------------


@pytest.mark.usefixtures("each_start_method")
def test_values_that_cannot_come_back_show_their_repr_and_keep_the_group(workers):
    workers.run_cell(DDP_CELL)
    workers.run_cell("train_step()")
    # The prepared DDP model: it pickles there, but needs a process group to unpickle here.
    shown = workers.run_cell("model")
    assert isinstance(shown, live.ValueOnWorker) and shown.rank == 0
    assert shown.type_name == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert "DistributedDataParallel(" in shown.text and "Linear(in_features=4" in shown.text
    assert repr(shown).startswith("# repr on worker rank 0")
    assert "DistributedDataParallel(\n  (module): Linear" in repr(shown)
    # A class defined only on the workers: this kernel has no such class.
    point = workers.run_cell(
        "class Point:\n"
        "    def __repr__(self):\n"
        "        return 'Point(rank=%d)' % accelerator.process_index\n"
        "Point()",
        return_all=True,
    )
    assert [value.text for value in point] == ["Point(rank=0)", "Point(rank=1)"]
    assert [value.rank for value in point] == [0, 1]
    assert "the kernel cannot unpickle it" in point[0].reason and "Point" in point[0].reason
    # A generator and a lambda cannot be pickled at all.
    generator = workers.run_cell("(step for step in range(3))")
    assert generator.text.startswith("<generator object <genexpr> at ")
    assert "cannot pickle" in generator.reason
    function = workers.run_cell("lambda x: x + 1")
    assert function.text.startswith("<function <lambda> at ")
    assert workers.run(lambda: lambda: 1).text.startswith("<function ")
    # Nothing was lost: the group is up, the model trains, the replicas agree.
    assert workers.alive
    assert workers.run_cell("train_step()") == 2
    assert_replicas_equal(workers)
    # Values that can travel still come back as themselves.
    assert workers.run_cell("[steps, {'w': accelerator.unwrap_model(model).bias.shape}]") == [
        2,
        {"w": torch.Size([1])},
    ]


# -- a dead worker is named ---------------------------------------------------------


def worker_pids(workers):
    return workers.run(os.getpid, return_all=True)


def test_a_worker_killed_between_calls_is_named_at_the_next_call(workers):
    pids = worker_pids(workers)
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(1.0)  # the next cell, a moment later
    with pytest.raises(WorkerError) as failure:
        workers.run_cell("1 + 1")
    assert failure.value.rank == 1 and failure.value.exitcode == -signal.SIGKILL
    assert "worker rank 1 was killed by SIGKILL" in str(failure.value)
    assert "workers.restart()" in str(failure.value)
    assert not workers.alive
    workers.restart()
    assert workers.run_cell("1 + 1") == 2


def test_a_worker_that_exits_between_calls_is_named_with_its_code(workers):
    exit_soon = "import os, threading\nthreading.Timer(0.2, os._exit, (7,)).start()"
    workers.run_cell(exit_soon, ranks=[0])
    time.sleep(1.5)
    with pytest.raises(WorkerError) as failure:
        workers.run_cell("1 + 1")
    assert failure.value.rank == 0 and failure.value.exitcode == 7
    assert "worker rank 0 exited with code 7" in str(failure.value)
    assert "workers.restart()" in str(failure.value)


def test_a_worker_killed_during_a_call_is_named(workers):
    pids = worker_pids(workers)
    workers.run_cell("import time")
    started = time.monotonic()
    timer = __import__("threading").Timer(0.5, os.kill, (pids[0], signal.SIGKILL))
    timer.start()
    try:
        with pytest.raises(WorkerError) as failure:
            workers.run_cell("time.sleep(30)")
    finally:
        timer.join()
    assert time.monotonic() - started < 10
    assert failure.value.rank == 0 and "killed by SIGKILL" in str(failure.value)
    assert "workers.restart()" in str(failure.value)
