"""Live workers on 2 CPU workers: state that stays between calls, output, errors,
stops and timeouts that leave the workers up, deaths that end the group."""

from __future__ import annotations

import os
import time

import pytest
import torch

from notebook_accel import WorkerError
from notebook_accel.live import GroupEnded, start_workers
from tests_support import PROMPTLY, SHIPPED, WhenPrinted, press_stop

# Every test runs twice (SHIPPED, tests/conftest.py's each_way_to_ship): with forked
# workers and with workers forked from the template. Stops, timeouts, deaths and ends depend
# on how a worker's process is watched and signalled: by a sentinel pipe and its pid (fork),
# or by a pidfd (launch/processes.py), and the two runs hold both. A "spawn" worker has the
# template's process handle (TemplateProcess is a FreshProcess) and runs its code; what is
# its own (a fresh interpreter's start, its parent-death signal) the launch tests check
# under every start method.


@pytest.fixture
def workers():
    group = start_workers(2, backend="cpu", live=False)
    yield group
    group.close()


def rank_and_pid():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), os.getpid()


@SHIPPED
def test_calls_reach_every_worker_and_return_real_objects(workers):
    assert workers.alive and workers.ranks == [0, 1]
    rank, world, pid = workers.run(rank_and_pid)
    assert (rank, world) == (0, 2) and pid != os.getpid()
    everyone = workers.run(rank_and_pid, return_all=True)
    assert [r for r, _, _ in everyone] == [0, 1] and everyone[0][2] == pid  # same processes
    assert workers.run(rank_and_pid, ranks=[1])[0] == 1
    assert workers.run(torch.arange, 3).tolist() == [0, 1, 2]
    assert workers.run_cell("x = 20\nx + 1", return_all=True) == [21, 21]
    with pytest.raises(ValueError, match=r"ranks=\[2\] must name some of this group's ranks"):
        workers.run(rank_and_pid, ranks=[2])


TRAIN_CELL = """
import torch
from notebook_accel import Accelerator

torch.manual_seed(0)
accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(64, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
steps = 0
"""


def defined_in_a_notebook(source: str, name: str):
    """A function as a notebook cell defines it: in `__main__`, so it travels by value
    and reads the worker's namespace."""
    namespace = {"__name__": "__main__"}
    exec(source, namespace)  # noqa: S102
    return namespace[name]


train = defined_in_a_notebook(
    """
def train(n):
    global steps
    for _ in range(n):
        loss = model(data).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        accelerator.log({"loss": loss.item()}, step=steps)
    print(f"rank {accelerator.process_index} at step {steps}", flush=True)
    return loss.item()
""",
    "train",
)


@SHIPPED
def test_a_model_stays_resident_between_calls(workers, capsys, tmp_path):
    workers.run_cell(TRAIN_CELL)
    first = workers.run(train, 5)
    assert workers.run_cell("steps") == 5
    workers.run_cell("for group in optimizer.param_groups: group['lr'] = 0.01")
    second = workers.run(train, 5)
    assert second < first
    assert workers.run_cell("(steps, optimizer.param_groups[0]['lr'])") == (10, 0.01)
    # DDP kept the replicas equal across calls
    weights = workers.run_cell("accelerator.unwrap_model(model).weight.detach()", return_all=True)
    assert torch.equal(weights[0], weights[1])
    out = capsys.readouterr().out
    assert "rank 0 at step 5\n" in out and "[rank 1] rank 1 at step 10\n" in out
    losses = [record.values["loss"] for record in workers.report.metrics if record.rank == 0]
    assert len(losses) == 10  # the history continues across calls
    workers.run_cell(f"accelerator.save_state({str(tmp_path / 'state')!r})")
    assert (tmp_path / "state").is_dir() and any((tmp_path / "state").iterdir())


def divide(by_zero_on):
    import torch.distributed as dist

    if dist.get_rank() == by_zero_on:
        return 1 / 0
    return "fine"


@SHIPPED
def test_an_exception_comes_back_and_the_workers_stay_up(workers):
    workers.run_cell("kept = 'still here'")
    with pytest.raises(WorkerError) as failure:
        workers.run(divide, 1)
    assert failure.value.rank == 1
    assert "ZeroDivisionError: division by zero" in str(failure.value)
    assert "return 1 / 0" in failure.value.traceback  # the user's own line
    assert "the workers are still running, with their state" in str(failure.value)
    with pytest.raises(WorkerError, match="NameError: name 'nowhere' is not defined"):
        workers.run_cell("nowhere + 1")
    assert workers.run_cell("kept") == "still here"


def sleep_then_answer(seconds):
    print("asleep", flush=True)
    time.sleep(seconds)
    return "woke"


@SHIPPED
def test_stop_interrupts_the_call_and_keeps_the_workers(workers):
    workers.run_cell("kept = 42")
    pressed_at = []
    # Pressed once both workers sleep, from the thread that runs the call.
    press = WhenPrinted("asleep", lambda: (pressed_at.append(time.monotonic()), press_stop()))
    workers.add_observer(press)
    with pytest.raises(KeyboardInterrupt, match="they are still running"):
        workers.run(sleep_then_answer, 600)
    assert press.done == 1
    assert time.monotonic() - pressed_at[0] < PROMPTLY  # the workers sleep for 600 s
    assert workers.alive and workers.run_cell("kept") == 42


train_until_stopped = defined_in_a_notebook(
    """
def train_until_stopped():
    global steps
    first = steps
    while not accelerator.check_trigger():  # a stop press: every rank leaves at one step
        loss = model(data).square().mean()
        accelerator.backward(loss)  # an all-reduce: a rank stopped alone would strand the other
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps == first + 1:
            print("training", flush=True)
    return steps
""",
    "train_until_stopped",
)


@SHIPPED
def test_a_training_loop_that_checks_stops_at_one_step_on_every_worker(workers):
    workers.run_cell(TRAIN_CELL)
    # Each time pressed mid-training (both ranks past a step), in the middle of DDP's
    # all-reduces.
    press = WhenPrinted("training", press_stop, times=3)
    workers.add_observer(press)
    before = 0
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt, match="they are still running"):
            workers.run(train_until_stopped)
        steps = workers.run_cell("steps", return_all=True)
        assert steps[0] == steps[1] > before
        before = steps[0]
    assert press.done == 3
    assert workers.alive
    weights = workers.run_cell("accelerator.unwrap_model(model).weight.detach()", return_all=True)
    assert torch.equal(weights[0], weights[1])


def ignore_stops():
    from notebook_accel.training import interrupts

    print("asleep", flush=True)
    deadline = time.monotonic() + 600
    while not interrupts.requested() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("not stopping", flush=True)  # the stop reached this worker
    try:
        time.sleep(600)
    except KeyboardInterrupt:
        time.sleep(600)  # a cell that will not stop, even when interrupted
    return "unreachable"


@SHIPPED
def test_a_second_stop_ends_a_group_that_does_not_stop(workers):
    # The first press once both workers sleep; the second once a worker shows that the
    # first reached it, while the kernel waits for the call to end.
    first = WhenPrinted("asleep", press_stop)
    second = WhenPrinted("not stopping", press_stop, ranks=1)
    workers.add_observer(first)
    workers.add_observer(second)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="a second stop") as stopped:
        workers.run(ignore_stops)
    assert (first.done, second.done) == (1, 1)
    assert time.monotonic() - started < PROMPTLY
    assert "the group was ended" in str(stopped.value)
    assert not workers.alive
    workers.restart()
    assert workers.run_cell("1 + 1") == 2


@SHIPPED
def test_the_launch_precision_reaches_the_workers():
    group = start_workers(2, backend="cpu", mixed_precision="bf16", live=False)
    try:
        cell = "from notebook_accel import Accelerator\nAccelerator().mixed_precision"
        assert group.run_cell(cell, return_all=True) == ["bf16", "bf16"]
    finally:
        group.close()


@SHIPPED
def test_a_timeout_interrupts_the_call_and_keeps_the_workers(workers):
    with pytest.raises(TimeoutError, match="still running with their state"):
        workers.run(sleep_then_answer, 600, timeout=0.5)
    assert workers.run(sleep_then_answer, 0, timeout=PROMPTLY) == "woke"


def never_stop():
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            time.sleep(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            pass  # code that will not be stopped
    return "unreachable"


@SHIPPED
def test_a_worker_that_will_not_stop_ends_the_group_which_restarts(workers):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the group was ended") as stopped:
        workers.run(never_stop, ranks=[1], timeout=0.5)
    assert time.monotonic() - started < PROMPTLY
    assert "workers.restart()" in str(stopped.value)
    assert not workers.alive
    with pytest.raises(GroupEnded, match="workers.restart"):
        workers.run(rank_and_pid)
    workers.restart()
    assert workers.run(rank_and_pid)[:2] == (0, 2)


@SHIPPED
def test_a_worker_that_dies_ends_the_group(workers):
    with pytest.raises(WorkerError) as failure:
        workers.run(os._exit, 3, ranks=[1])
    assert failure.value.rank == 1 and failure.value.exitcode == 3
    assert "the group was ended" in str(failure.value)
    assert "workers.restart() starts a new group" in str(failure.value)
    assert not workers.alive
    workers.restart()
    assert workers.run_cell("1 + 1") == 2


@SHIPPED
def test_closing_ends_every_worker_and_later_calls_say_so(workers):
    pids = [pid for _, _, pid in workers.run(rank_and_pid, return_all=True)]
    workers.close()
    workers.close()  # twice is fine
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(GroupEnded, match="it was closed"):
        workers.run_cell("1")


def test_the_magic_says_how_to_use_it():
    from notebook_accel.live import magic

    assert magic._parse("--ranks 0,1 --all --timeout 2.5").ranks == [0, 1]
    with pytest.raises(ValueError, match="does not take --bogus"):
        magic._parse("--bogus")
    with pytest.raises(ValueError, match="--ranks takes rank numbers"):
        magic._parse("--ranks a,b")


KILLED_KERNEL = """
import os, sys, time
from notebook_accel.live import start_workers

workers = start_workers(2, backend="cpu", live=False)
pids = [pid for _, _, pid in workers.run(lambda: (0, 0, os.getpid()), return_all=True)]
print(" ".join(map(str, pids)), flush=True)
time.sleep(60)
"""


@SHIPPED
def test_live_workers_end_with_a_kernel_that_is_killed(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "kernel.py"
    script.write_text(KILLED_KERNEL)
    kernel = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        pids = [int(pid) for pid in kernel.stdout.readline().split()]
        assert len(pids) == 2
        kernel.kill()  # as a kernel restart does
        kernel.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids)
    finally:
        kernel.kill()
        kernel.wait(10)
        kernel.stdout.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
