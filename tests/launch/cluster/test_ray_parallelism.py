"""HSDP on a real Ray cluster, two workers of half a CPU on each of two of the suite's
cluster's nodes: each node's two workers shard the model between them, and the two nodes
replicate it (the dp_replicate dimension across the nodes), training as DDP on four local
workers."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher

pytestmark = pytest.mark.timeout(300)


def train(hsdp: bool) -> dict:
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) if hsdp else None
    accelerator = Accelerator(parallelism_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    disks = accelerator.gather_for_metrics([os.environ.get("NODE_DISK", "")])
    return {"weights": accelerator.get_state_dict(model), "disks": disks}


def test_hsdp_replicates_across_the_two_nodes_and_trains_as_ddp(ray_cluster):
    local = notebook_launcher(train, args=(False,), num_processes=4, backend="cpu", timeout=120)
    # Two on each node: half a CPU each, so that two fit on a node of the cluster's one.
    spread = notebook_launcher(
        train,
        args=(True,),
        num_processes=4,
        workers_per_node=2,
        cpus_per_worker=0.5,
        backend="cpu",
        timeout=240,
        cluster="ray",
    )
    first, second = spread["disks"][:2], spread["disks"][2:]
    # ranks 0-1 on one node, 2-3 on the other: each shard group inside a node
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    assert {first[0], second[0]} <= {str(disk) for disk in ray_cluster.disks.values()}
    for name, reference in local["weights"].items():
        torch.testing.assert_close(spread["weights"][name], reference, atol=1e-6, rtol=0)
