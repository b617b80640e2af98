"""Live workers on a Ray cluster of two nodes: a model stays on every node between calls, and
calls fail, stop and regroup as they do on one machine."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from notebook_accel import WorkerError, start_workers

ON_TWO_NODES = {"cluster": "ray", "placement_strategy": "STRICT_SPREAD", "live": False}


def set_up():
    global accelerator, model, optimizer, data
    from notebook_accel import Accelerator, set_seed

    set_seed(0)
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    data = (torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
    return os.environ["NODE_DISK"]


def step():
    loss = torch.nn.functional.mse_loss(model(data[0]), data[1])
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return accelerator.reduce(loss.detach(), "mean").item()


def fails_on_rank_one():
    if accelerator.process_index == 1:
        raise ValueError("a bad batch on rank 1")
    return "fine"


def rank_one_leaves_a_collective():
    if accelerator.process_index == 1:
        raise RuntimeError("rank 1 gives up")
    return accelerator.reduce(torch.ones(1)).item()  # waits for rank 1, which never comes


def reduce_ones():
    return accelerator.reduce(torch.ones(1)).item()


def sleeps():
    time.sleep(600)


def test_a_model_stays_on_every_node_and_calls_fail_and_regroup_as_on_one_machine(ray_cluster):
    workers = start_workers(2, **ON_TWO_NODES)
    try:
        disks = workers.run(set_up, return_all=True)
        assert set(disks) == {str(disk) for disk in ray_cluster.disks.values()}
        losses = [workers.run(step) for _ in range(5)]
        assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]

        with pytest.raises(WorkerError) as raised:
            workers.run(fails_on_rank_one)
        assert "worker rank 1 raised ValueError: a bad batch on rank 1" in str(raised.value)
        assert workers.alive

        with pytest.raises(WorkerError) as raised:
            workers.run(rank_one_leaves_a_collective, timeout=60)
        assert "the process group was formed again" in str(raised.value)
        assert workers.run(reduce_ones) == 2.0
        assert workers.run(step) < losses[-1]  # the prepared model trains on

        threading.Timer(1.0, workers.interrupt).start()
        with pytest.raises(KeyboardInterrupt, match="the call was stopped on every worker"):
            workers.run(sleeps)
        assert workers.run(step) > 0  # stopped, with its state
    finally:
        workers.close()
    assert not workers.alive
