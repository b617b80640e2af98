"""A stop press at any moment of a launch: KeyboardInterrupt, and the process as it was.

Each case presses "stop" (SIGINT to this process) right before or right after
one step of the launch (binding the port, forking the janitor or a worker,
creating the store, the first wait, a worker's exit, each teardown step, each
event), by wrapping that step; then randomised presses over many launches
catch the moments between the steps. Every time: KeyboardInterrupt (or the
result, where the press came after the launch returned), no process left,
the same open file descriptors (none closed twice, none leaked), SIGINT's
handler as it was, and the next launch works.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch.distributed as dist

from notebook_accel import notebook_launcher
from notebook_accel.launch import forking, rendezvous, supervisor, template
from notebook_accel.reporting.events import AttemptStarted, Result, RunEnded, WorkerExited
from notebook_accel.reporting.observers import RunObserver
from tests_support import live_children
from tests_support import open_fds_once_back_to as fds_back_to

# Every test here runs with forked workers and with workers in fresh interpreters.
pytestmark = pytest.mark.usefixtures("each_start_method")


def short(seconds: float) -> int:
    time.sleep(seconds)
    return int(os.environ["RANK"]) + 100


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def press() -> None:
    signal.raise_signal(signal.SIGINT)


def pressing(function, when: str):
    """`function`, with a stop press right before or right after it runs."""

    def wrapped(*args, **kwargs):
        if when == "before":
            press()
        result = function(*args, **kwargs)
        if when == "after":
            press()
        return result

    return wrapped


def pressing_after_fork(real_fork):
    def fork() -> int:
        pid = real_fork()
        if pid != 0:  # in the launching process only
            press()
        return pid

    return fork


STEPS = [
    (rendezvous, "_listening_socket"),
    (dist, "TCPStore"),
    (forking.Janitor, "start"),
    (supervisor.WorkerGroup, "_start_one"),
    (supervisor.WorkerGroup, "poll_until"),
    (supervisor.WorkerGroup, "_on_exit"),
    (supervisor.WorkerGroup, "stop"),
    (supervisor, "end_processes"),
    (forking.Janitor, "close"),
    (rendezvous.Rendezvous, "__exit__"),
    (supervisor.StopSignal, "close"),
]


class PressOn(RunObserver):
    """Presses stop when the launch emits an event of one kind."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def on_event(self, event, report) -> None:
        if isinstance(event, self.kind):
            press()


@pytest.fixture(scope="module")
def launched_once():
    # The first store in a process opens descriptors torch keeps for good.
    assert notebook_launcher(short, args=(0,), num_processes=2, backend="cpu", live=False) == 100


def template_fds() -> set[int]:
    """What this process holds open for its template processes (each one's socket): the
    template of start method "forkserver" outlives a launch on purpose."""
    state = template._STATE
    with state.lock:
        templates = [each for each in (state.current, *state.retired) if each is not None]
    return {each._sock.fileno() for each in templates if each._sock is not None}


@pytest.fixture
def as_it_was(launched_once):
    handler = signal.getsignal(signal.SIGINT)
    fds = open_fds() - template_fds()
    yield
    assert live_children() == []
    assert signal.getsignal(signal.SIGINT) is handler
    # The template lasts into the next test, as into a kernel's next launch (a new one
    # imports torch: about 3 s on 2 cores); any other descriptor shows.
    assert fds_back_to(fds, leaving_out=template_fds) == fds


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("owner", "name"), STEPS, ids=[name for _, name in STEPS])
def test_a_press_at_each_step_interrupts_and_leaves_nothing(
    monkeypatch, as_it_was, owner, name, when
):
    monkeypatch.setattr(owner, name, pressing(getattr(owner, name), when))
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(short, args=(0.05,), num_processes=2, backend="cpu", live=False)


def test_a_press_right_after_each_fork_interrupts_and_leaves_nothing(monkeypatch, as_it_was):
    monkeypatch.setattr(os, "fork", pressing_after_fork(os.fork))
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(short, args=(0.05,), num_processes=2, backend="cpu", live=False)


@pytest.mark.parametrize("kind", [AttemptStarted, Result, WorkerExited, RunEnded])
def test_a_press_at_each_event_interrupts_and_leaves_nothing(as_it_was, kind):
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(
            short,
            args=(0.05,),
            num_processes=2,
            backend="cpu",
            live=False,
            observers=[PressOn(kind)],
        )


def launch_pressed_after(delay: float) -> str:
    """One short launch with a stop press `delay` seconds after the call: its outcome."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    outcome = "finished"
    try:
        try:
            timer.start()
            assert (
                notebook_launcher(short, args=(0.05,), num_processes=2, backend="cpu", live=False)
                == 100
            )
        finally:
            while True:  # the press may land right here too
                try:
                    timer.cancel()
                    timer.join(10)
                    break
                except KeyboardInterrupt:
                    outcome = "interrupted"
    except KeyboardInterrupt:
        outcome = "interrupted"
    return outcome


def test_presses_at_random_moments_of_many_launches(as_it_was):
    rng = random.Random(1234)
    outcomes = [launch_pressed_after(rng.uniform(0.0, 0.3)) for _ in range(30)]
    # Both kinds happened: the presses landed during launches and after them.
    assert "interrupted" in outcomes
    print(f"30 launches: {outcomes.count('interrupted')} interrupted, the rest finished")
    assert live_children() == []
    # The next launch in this process works.
    assert notebook_launcher(short, args=(0,), num_processes=2, backend="cpu", live=False) == 100
