"""The notebook's stop button: SIGINT in the launching process."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from notebook_accel import last_run, notebook_launcher
from tests_support import PROMPTLY, live_children

# Every test here runs with forked workers and with workers in fresh interpreters.
pytestmark = pytest.mark.usefixtures("each_start_method")

WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1)


def sleeps(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_interrupt_stops_every_worker_and_leaves_the_process_as_it_was():
    handlers = {signum: signal.getsignal(signum) for signum in WATCHED_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(sleeps, args=(600,), num_processes=2, backend="cpu")
        interrupted_at = time.monotonic()
    finally:
        timer.cancel()
    assert live_children() == []
    assert time.monotonic() - interrupted_at < PROMPTLY  # the workers sleep for 600 s
    assert last_run().status == "stopped"
    assert {signum: signal.getsignal(signum) for signum in WATCHED_SIGNALS} == handlers
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask
    # The next launch in the same process works.
    assert notebook_launcher(sleeps, args=(0,), num_processes=2, backend="cpu") != os.getpid()


def test_interrupt_during_teardown_does_not_leave_workers():
    # A second stop press while the first is being handled.
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (0.8, 0.85)]
    for timer in timers:
        timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(sleeps, args=(600,), num_processes=2, backend="cpu")
            time.sleep(1)
    finally:
        for timer in timers:
            timer.cancel()
    time.sleep(0.2)
    assert live_children() == []


def ignores_sigterm_then_sleeps():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL will end it
    time.sleep(600)


def test_a_second_stop_press_during_teardown_still_leaves_no_worker():
    # The second SIGINT lands while the launcher waits for SIGTERM to work.
    handler = signal.getsignal(signal.SIGINT)
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (1.0, 1.3)]
    for timer in timers:
        timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(ignores_sigterm_then_sleeps, num_processes=2, backend="cpu")
    finally:
        for timer in timers:
            timer.cancel()
    assert live_children() == []
    assert signal.getsignal(signal.SIGINT) is handler
