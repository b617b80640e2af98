"""The device mesh a ParallelismConfig builds, on real gloo workers: Accelerate's flattened
dimensions ("dp", "dp_shard_cp", "dp_cp") hold the right ranks and their groups
all-reduce, and context parallelism rotates keys and values as configured."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from notebook_accel import Accelerator, ParallelismConfig, notebook_launcher

FOUR = {"num_processes": 4, "backend": "cpu", "timeout": 120, "return_all": True}
FLATTENED = ("dp", "dp_shard_cp", "dp_cp")


def flattened_groups(sizes: dict) -> dict:
    """Each flattened dimension of the accelerator's mesh: its ranks here, and the sum of
    the ranks all-reduced over its group (None where the mesh lacks it)."""
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = accelerator.torch_device_mesh
    groups = {}
    for name in FLATTENED:
        try:
            flat = mesh[name]  # what a notebook written for Accelerate does
        except KeyError:
            groups[name] = None
            continue
        total = torch.tensor([float(accelerator.process_index)])
        dist.all_reduce(total, group=flat.get_group())
        groups[name] = (flat.mesh.tolist(), total.item())
    return {"groups": groups, "warned": [str(w.message) for w in caught]}


# rank -> its group of each flattened dimension, and the sum of that group's ranks
HSDP_2X2 = [
    {"dp": ([0, 1, 2, 3], 6.0), "dp_shard_cp": ([0, 1], 1.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([0, 1, 2, 3], 6.0), "dp_shard_cp": ([0, 1], 1.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([0, 1, 2, 3], 6.0), "dp_shard_cp": ([2, 3], 5.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([0, 1, 2, 3], 6.0), "dp_shard_cp": ([2, 3], 5.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
]
FSDP_2_X_CP_2 = [  # ranks 0 and 1 read one batch (a cp pair): dp pairs them across
    {"dp": ([0, 2], 2.0), "dp_shard_cp": ([0, 1, 2, 3], 6.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([1, 3], 4.0), "dp_shard_cp": ([0, 1, 2, 3], 6.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([0, 2], 2.0), "dp_shard_cp": ([0, 1, 2, 3], 6.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
    {"dp": ([1, 3], 4.0), "dp_shard_cp": ([0, 1, 2, 3], 6.0), "dp_cp": ([0, 1, 2, 3], 6.0)},
]
FSDP_2_X_TP_2 = [
    dict.fromkeys(FLATTENED, ([0, 2], 2.0)),
    dict.fromkeys(FLATTENED, ([1, 3], 4.0)),
    dict.fromkeys(FLATTENED, ([0, 2], 2.0)),
    dict.fromkeys(FLATTENED, ([1, 3], 4.0)),
]
DDP_4 = [{"dp": ([0, 1, 2, 3], 6.0), "dp_shard_cp": None, "dp_cp": ([0, 1, 2, 3], 6.0)}] * 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, HSDP_2X2),
        ({"dp_shard_size": 2, "cp_size": 2}, FSDP_2_X_CP_2),
        ({"dp_shard_size": 2, "tp_size": 2}, FSDP_2_X_TP_2),
        ({"dp_replicate_size": 4}, DDP_4),
    ],
    ids=["hsdp-2x2", "fsdp-2-x-cp-2", "fsdp-2-x-tp-2", "ddp-4"],
)
def test_the_mesh_holds_accelerate_s_flattened_dimensions(sizes, expected):
    per_rank = notebook_launcher(flattened_groups, args=(sizes,), **FOUR)
    assert [rank["groups"] for rank in per_rank] == expected
    # built from the whole mesh's own dimensions: nothing torch deprecates
    assert [rank["warned"] for rank in per_rank] == [[]] * 4


def rotation(strategy: str | None) -> str:
    """The way torch's context parallelism passes keys and values around inside
    maybe_context_parallel, with the cp_comm_strategy given (None: the default)."""
    from notebook_accel.internals import context_parallel
    from notebook_accel.utils import TorchContextParallelConfig

    handler = TorchContextParallelConfig(cp_comm_strategy=strategy) if strategy else None
    accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=2, cp_handler=handler))
    tokens = torch.randn(1, 8, 4)
    with accelerator.maybe_context_parallel(buffers=[tokens], buffer_seq_dims=[1]):
        return context_parallel.rotate_method()


@pytest.mark.timeout(240)
def test_context_parallel_rotates_as_the_cp_comm_strategy_says(monkeypatch):
    two = {"num_processes": 2, "backend": "cpu", "timeout": 120, "return_all": True}
    assert notebook_launcher(rotation, args=("alltoall",), **two) == ["alltoall"] * 2
    # Accelerate's variable, read by the workers' ParallelismConfig
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert notebook_launcher(rotation, args=(None,), **two) == ["alltoall"] * 2
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
    assert notebook_launcher(rotation, args=(None,), **two) == ["allgather"] * 2
