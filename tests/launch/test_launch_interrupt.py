"""The notebook's stop button: SIGINT in the launching process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from notebook_accel import last_run, notebook_launcher
from notebook_accel.launch import processes, supervisor
from notebook_accel.platforms import accelerator
from tests_support import PROMPTLY, WhenPrinted, live_children, press_stop

# Every test here runs with forked workers and with workers in fresh interpreters.
pytestmark = pytest.mark.usefixtures("each_start_method")

WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1)


def sleeps(seconds):
    print("asleep", flush=True)
    time.sleep(seconds)
    return os.getpid()


@pytest.mark.timeout(PROMPTLY * 4)  # two launches, each in fresh interpreters under spawn
def test_interrupt_stops_every_worker_and_leaves_the_process_as_it_was():
    handlers = {signum: signal.getsignal(signum) for signum in WATCHED_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    pressed_at = []
    # Pressed once both workers sleep, from the thread that runs the launch.
    press = WhenPrinted("asleep", lambda: (pressed_at.append(time.monotonic()), press_stop()))
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleeps, args=(600,), num_processes=2, backend="cpu", observers=[press])
    assert press.done == 1
    assert time.monotonic() - pressed_at[0] < PROMPTLY  # the workers sleep for 600 s
    assert live_children() == []
    assert last_run().status == "stopped"
    assert {signum: signal.getsignal(signum) for signum in WATCHED_SIGNALS} == handlers
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask
    # The next launch in the same process works.
    assert notebook_launcher(sleeps, args=(0,), num_processes=2, backend="cpu") != os.getpid()


def pressing_second(function, presses: list[str]):
    """`function`, with the second stop press right before it runs, once the first was
    made (recorded in `presses`)."""

    def wrapped(*args, **kwargs):
        if presses == ["first"]:
            presses.append("second")
            press_stop()
        return function(*args, **kwargs)

    return wrapped


def test_a_second_stop_press_while_the_first_is_handled_does_not_leave_workers(monkeypatch):
    # The first press lands while the workers sleep; the second once the launch has
    # answered it and begins to end the workers.
    presses: list[str] = []
    first = WhenPrinted("asleep", lambda: (presses.append("first"), press_stop()))
    ending = pressing_second(supervisor.end_processes, presses)
    monkeypatch.setattr(supervisor, "end_processes", ending)
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleeps, args=(600,), num_processes=2, backend="cpu", observers=[first])
    assert presses == ["first", "second"]
    assert live_children() == []


def ignores_sigterm_then_sleeps():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL will end it
    print("asleep", flush=True)
    time.sleep(600)


def test_a_second_stop_press_during_teardown_still_leaves_no_worker(monkeypatch):
    # The second SIGINT lands while the launcher waits for SIGTERM to work (its first
    # wait for the workers' exit), which these workers ignore.
    handler = signal.getsignal(signal.SIGINT)
    presses: list[str] = []
    first = WhenPrinted("asleep", lambda: (presses.append("first"), press_stop()))
    waiting = pressing_second(processes.wait_for_exit, presses)
    monkeypatch.setattr(processes, "wait_for_exit", waiting)
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(
            ignores_sigterm_then_sleeps, num_processes=2, backend="cpu", observers=[first]
        )
    assert presses == ["first", "second"]
    assert live_children() == []
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_press_while_the_hardware_is_looked_at_stops_the_launch_before_it_starts(monkeypatch):
    # The search for device packages takes the import system's global lock; a
    # KeyboardInterrupt raised there can leave that lock taken for good (every other
    # thread that imports would then wait for ever), so the press is answered after.
    looked_for: list[str] = []
    real_installed = accelerator._installed

    def pressed_while_looking(package: str) -> bool:
        press_stop()
        found = real_installed(package)
        looked_for.append(package)
        return found

    monkeypatch.setattr(accelerator, "_installed", pressed_while_looking)
    report = last_run()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(sleeps, args=(600,), num_processes=2, backend="cpu")
    assert looked_for, "the search was cut short by the press"
    assert last_run() is report  # no launch started
    assert live_children() == []
