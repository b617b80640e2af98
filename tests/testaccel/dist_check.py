"""One rank of the distributed check of testaccel and testccl, in a process of its own:
collectives, object collectives, DDP on testaccel (and the same DDP on CPU over gloo,
for comparison) and FSDP2 (with a single-process reference computed here too). Saves what
it found with torch.save for the test to compare.

Usage: python -m testaccel.dist_check RANK WORLD_SIZE INIT_FILE OUT_FILE [BACKEND]
(with tests/ on PYTHONPATH).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import testaccel

STEPS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator))
        for _ in range(STEPS)
    ]


def train_ddp(device, group, device_ids, rank: int) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = make_model().to(device)
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for x, y in batches(rank):
        loss = F.mse_loss(ddp(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


def train_fsdp(device, world: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = make_model()
    model = copy.deepcopy(reference).to(device)
    mesh = init_device_mesh(testaccel.DEVICE_TYPE, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in batches(rank):
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    local = [p.to_local().detach().cpu() for p in model.parameters()]

    # The same steps in one process over every rank's batch at once.
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    every = [batches(r) for r in range(world)]
    for step in range(STEPS):
        x = torch.cat([every[r][step][0] for r in range(world)])
        y = torch.cat([every[r][step][1] for r in range(world)])
        loss = F.mse_loss(reference(x), y)
        ref_optimizer.zero_grad()
        loss.backward()
        ref_optimizer.step()
    expected = [p.detach().chunk(world)[rank] for p in reference.parameters()]
    return local, expected


def main(rank: int, world: int, init_file: str, out_file: str, backend: str) -> None:
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device(testaccel.DEVICE_TYPE, rank)
    torch.testaccel.set_device(rank)
    found: dict = {"backend": dist.get_backend()}

    tensor = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(tensor)
    found["all_reduce"] = (str(tensor.device), tensor.cpu())

    gathered = torch.empty(world * 2, device=device)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device=device))
    found["all_gather_into_tensor"] = gathered.cpu()

    scattered = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(scattered, torch.arange(world * 2.0, device=device))
    found["reduce_scatter_tensor"] = scattered.cpu()

    parts = [torch.empty(1, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((1,), float(rank), device=device))
    found["all_gather"] = [p.cpu() for p in parts]

    objects: list = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    found["all_gather_object"] = objects
    broadcast = [f"from {rank}"]
    dist.broadcast_object_list(broadcast, src=0)
    found["broadcast_object_list"] = broadcast[0]
    dist.barrier()

    gloo = dist.new_group(backend="gloo")
    found["ddp_accel"] = train_ddp(device, None, [rank], rank)
    found["ddp_accel_no_ids"] = train_ddp(device, None, None, rank)
    found["ddp_cpu"] = train_ddp(torch.device("cpu"), gloo, None, rank)
    found["fsdp"], found["fsdp_expected"] = train_fsdp(device, world, rank)

    dist.barrier()
    dist.destroy_process_group()
    torch.save(found, out_file)


if __name__ == "__main__":
    backend = sys.argv[5] if len(sys.argv) > 5 else testaccel.BACKEND
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], backend)
