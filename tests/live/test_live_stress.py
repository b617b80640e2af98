"""100 calls on live workers with random stops, exceptions and timeouts; then the
training state is intact, nothing hung and nothing leaked (tests/conftest.py
checks for leftover processes)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import psutil
import pytest

from notebook_accel import WorkerError
from notebook_accel.live import start_workers

SETUP = """
import torch
from notebook_accel import Accelerator

torch.manual_seed(0)
accelerator = Accelerator()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
steps = 0
"""

TRAIN = """
loss = model(torch.ones(16, 8)).square().mean()
accelerator.backward(loss)
optimizer.step()
optimizer.zero_grad()
steps += 1
(steps, round(loss.item(), 6))
"""


def nap(seconds):
    time.sleep(seconds)
    return seconds


def fail_on(rank):
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} failed on purpose")
    return "ok"


@pytest.mark.timeout(600)
def test_a_hundred_calls_with_random_stops_errors_and_timeouts():
    chooser = random.Random(1234)
    me = psutil.Process()
    fds_before = me.num_fds()
    workers = start_workers(2, backend="cpu", live=False)
    try:
        workers.run_cell(SETUP)
        trained = 0
        outcomes = {"ok": 0, "error": 0, "stopped": 0, "timeout": 0}
        for _ in range(100):
            kind = chooser.choice(["train", "train", "nap", "error", "stop", "timeout"])
            if kind == "train":
                steps, _ = workers.run_cell(TRAIN)
                trained += 1
                assert steps == trained
                outcomes["ok"] += 1
            elif kind == "nap":
                assert workers.run(nap, 0.01) == 0.01
                outcomes["ok"] += 1
            elif kind == "error":
                with pytest.raises(WorkerError, match="failed on purpose"):
                    workers.run(fail_on, chooser.choice([0, 1]))
                outcomes["error"] += 1
            elif kind == "stop":
                timer = threading.Timer(
                    chooser.uniform(0.0, 0.2), os.kill, (os.getpid(), signal.SIGINT)
                )
                try:
                    timer.start()
                    workers.run(nap, 5)
                except KeyboardInterrupt:
                    outcomes["stopped"] += 1
                finally:
                    timer.join()
            else:
                with pytest.raises(TimeoutError):
                    workers.run(nap, 5, timeout=chooser.uniform(0.05, 0.3))
                outcomes["timeout"] += 1
            assert workers.alive
        # The model and optimizer came through every interruption.
        steps, loss = workers.run_cell(TRAIN)
        assert steps == trained + 1 and loss == loss  # a number, not NaN
        assert all(outcomes[key] for key in outcomes), outcomes
    finally:
        workers.close()
    assert me.num_fds() <= fds_before + 2, "descriptors leaked"
