"""HSDP on a real Ray cluster, on two nodes of 2 CPUs that join the suite's cluster for it:
each node's two workers shard the model between them, and the two nodes replicate it (the
dp_replicate dimension across the nodes), training as DDP on four local workers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cluster_support import LocalCluster
from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def two_cpu_nodes(ray_cluster: LocalCluster) -> Iterator[list]:
    """Two nodes of 2 CPUs each, beside the cluster's two of 1 CPU: two workers per node."""
    with ray_cluster.more_nodes(2, num_cpus=2) as nodes:
        yield nodes


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


def test_hsdp_replicates_across_the_two_nodes_and_trains_as_ddp(ray_cluster, two_cpu_nodes):
    local = notebook_launcher(train, args=(False,), num_processes=4, backend="cpu", timeout=120)
    # Two on each node: only the two nodes of 2 CPUs can hold them.
    spread = notebook_launcher(
        train,
        args=(True,),
        num_processes=4,
        workers_per_node=2,
        backend="cpu",
        timeout=240,
        cluster="ray",
    )
    first, second = spread["disks"][:2], spread["disks"][2:]
    # ranks 0-1 on one node, 2-3 on the other: each shard group inside a node
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    assert {first[0], second[0]} == {str(ray_cluster.disks[n.node_id]) for n in two_cpu_nodes}
    for name, reference in local["weights"].items():
        torch.testing.assert_close(spread["weights"][name], reference, atol=1e-6, rtol=0)
