"""Live workers on a Ray cluster of two nodes: a model stays on every node between calls,
calls fail, stop and regroup as they do on one machine, and close() frees what they held
(their agents are kept warm only when keep_warm is passed)."""

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


def agent_of_this_worker():
    return os.getppid()  # a worker is forked from its agent


def test_close_frees_every_agent_placement_group_and_cpu(ray_cluster):
    # Imported here: a live call names this module for its workers to import, and they
    # do not have the tests' own folder on their path.
    from cluster_support import wait_until_nothing_is_left

    workers = start_workers(2, **ON_TWO_NODES)
    try:
        assert len(set(workers.run(agent_of_this_worker, return_all=True))) == 2
    finally:
        workers.close()
    # Before the fixture's release_cluster(): close() alone frees them.
    assert wait_until_nothing_is_left(ray_cluster) == []


def test_with_keep_warm_close_keeps_the_agents_for_the_next_group(ray_cluster):
    from cluster_support import ours_still_running, wait_until_nothing_is_left

    workers = start_workers(2, keep_warm=60, **ON_TWO_NODES)
    try:
        agents = workers.run(agent_of_this_worker, return_all=True)
    finally:
        workers.close()
    held = ours_still_running(ray_cluster)
    assert any(item.startswith("placement group") for item in held), held
    again = start_workers(2, **ON_TWO_NODES)  # the same shape: the warm agents serve it
    try:
        assert again.run(agent_of_this_worker, return_all=True) == agents
    finally:
        again.close()
    assert wait_until_nothing_is_left(ray_cluster) == []
