"""Many short launches at once: random stop presses, random worker deaths, two threads.

The main thread launches as a cell does, with stop presses (SIGINT) at
random moments; a second thread launches as a panel does, stopped at random
moments through its StopSignal; in both, a random worker raises, exits or is
killed, and half the runs join a gloo group. Checked: nothing hangs (every
launch has a timeout, so a hang shows as TimeoutError, and the thread has a
bounded join), every error is a documented one (KeyboardInterrupt for a stop,
WorkerError for a worker's death), each finished run returns its result, and
in the end no process and no descriptor is left.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from notebook_accel import WorkerError, notebook_launcher
from notebook_accel.launch.launcher import run_plan
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.launch.supervisor import StopSignal
from notebook_accel.reporting.observers import RunObserver
from tests_support import live_children
from tests_support import open_fds_once_back_to as fds_back_to

# Every test here runs with forked workers and with workers in fresh interpreters.
pytestmark = pytest.mark.usefixtures("each_start_method")

# How many launches each thread makes: a count, not a time budget, so that a busy
# machine makes the test slower, not different (a fresh interpreter takes 1-2 s to start).
LAUNCHES = {"fork": 16, "forkserver": 16, "spawn": 10}
# Far beyond any of these launches: reaching it means a launch hung.
LAUNCH_TIMEOUT = 30.0


def flaky(seconds: float, dies: int | None, how: str, collective: bool) -> int:
    rank = int(os.environ["RANK"])
    if collective:
        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
    time.sleep(seconds)
    if rank == dies:
        if how == "raise":
            raise RuntimeError("planned failure")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if collective:
        dist.barrier()
    return rank + 100


def random_launch(rng: random.Random) -> tuple[tuple, int | None]:
    dies = rng.choice([None, None, 0, 1])
    args = (rng.uniform(0.0, 0.2), dies, rng.choice(["raise", "exit", "kill"]), rng.random() < 0.5)
    return args, dies


def outcome_of(call, dies: int | None) -> str:
    """Run one launch; name what came of it, or raise if that is not documented."""
    try:
        value = call()
    except KeyboardInterrupt:
        return "stopped"
    except WorkerError as error:
        assert dies is not None, f"no worker was meant to fail: {error}"
        return "worker error"
    assert value == 100 and dies is None, (value, dies)
    return "finished"


class Quiet(RunObserver):
    def on_event(self, event, report) -> None:
        pass


def panel_style_launches(rng: random.Random, launches: int, outcomes: Counter) -> None:
    for _ in range(launches):
        args, dies = random_launch(rng)
        plan = plan_launch(
            function=flaky,
            args=args,
            num_processes=2,
            backend="cpu",
            timeout=LAUNCH_TIMEOUT,
            single_in_process=False,
        )
        stop = StopSignal()
        timer = threading.Timer(rng.uniform(0.0, 0.4), stop.set) if rng.random() < 0.4 else None
        if timer is not None:
            timer.start()
        try:
            outcomes[outcome_of(functools.partial(run_plan, plan, Quiet(), stop=stop), dies)] += 1
        finally:
            if timer is not None:
                timer.cancel()
                timer.join(10)
            stop.close()


def cell_style_launch(rng: random.Random, outcomes: Counter) -> None:
    args, dies = random_launch(rng)
    delay = rng.uniform(0.0, 0.4) if rng.random() < 0.4 else None
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) if delay else None
    outcome = None
    try:
        try:
            if timer is not None:
                timer.start()
            outcome = outcome_of(
                lambda: notebook_launcher(
                    flaky,
                    args=args,
                    num_processes=2,
                    backend="cpu",
                    timeout=LAUNCH_TIMEOUT,
                    live=False,
                    output="none",
                ),
                dies,
            )
        finally:
            while timer is not None:  # the press may land here, after the launch
                try:
                    timer.cancel()
                    timer.join(10)
                    break
                except KeyboardInterrupt:
                    outcome = outcome or "stopped"
    except KeyboardInterrupt:
        outcome = "stopped"
    outcomes[outcome] += 1


@pytest.mark.timeout(300)
def test_random_stops_deaths_and_two_launching_threads_never_hang_or_leak(each_start_method):
    # The first store in a process opens descriptors torch keeps for good.
    assert flaky_once() == 100
    fds = {int(name) for name in os.listdir("/proc/self/fd")}
    handler = signal.getsignal(signal.SIGINT)
    rng = random.Random(20240611)
    launches = LAUNCHES[each_start_method]
    cell, panel = Counter(), Counter()
    failures: list[BaseException] = []

    def panel_thread() -> None:
        try:
            panel_style_launches(random.Random(rng.random()), launches, panel)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    thread = threading.Thread(target=panel_thread, name="panel-style-launches", daemon=True)
    thread.start()
    try:
        for _ in range(launches):
            cell_style_launch(rng, cell)
    finally:
        thread.join(launches * LAUNCH_TIMEOUT)
    assert not thread.is_alive(), "a panel-style launch hung"
    assert not failures, failures
    print(f"cell-style launches: {dict(cell)}; panel-style launches: {dict(panel)}")
    assert sum(cell.values()) == launches and sum(panel.values()) == launches
    assert cell["finished"] and panel["finished"] and cell["stopped"] and panel["stopped"]
    assert cell["worker error"] and panel["worker error"]
    assert live_children() == []
    assert signal.getsignal(signal.SIGINT) is handler
    assert fds_back_to(fds) == fds


def flaky_once() -> int:
    return notebook_launcher(
        flaky, args=(0.0, None, "raise", True), num_processes=2, backend="cpu", live=False
    )
