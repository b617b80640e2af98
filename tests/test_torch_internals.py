"""Each private torch API the package uses, on the running torch: present, doing what it
is used for, and named with the tested range where it is missing.

Part of the compatibility subset run on each end of the tested range
(tests/torch_range), so every guard is checked on every torch of the range.
"""

from __future__ import annotations

import importlib
import re
from datetime import timedelta
from pathlib import Path

import pytest
import tomllib
import torch
import torch.distributed as dist

from notebook_accel import internals
from notebook_accel.internals import (
    c10d,
    context_parallel,
    cuda,
    ddp,
    dynamo,
    mesh,
    tensors,
    tested_range,
)

REPO = Path(__file__).resolve().parents[1]


def test_the_running_torch_has_every_private_api_the_package_uses():
    assert "outside" not in str(tested_range.untested()), "the tests run on a tested torch"
    assert [api.name for api in internals.missing()] == []
    names = [api.name for api in internals.all_apis()]
    assert len(names) == len(set(names)) >= 10
    for api in internals.all_apis():
        assert api.needed_for and api.without_it, api.name


def test_the_declared_torch_is_the_oldest_of_the_tested_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = next(dep for dep in project["dependencies"] if dep.startswith("torch"))
    oldest = ".".join(map(str, tested_range.release(tested_range.TESTED_TORCH[0])))
    assert declared == f"torch>={oldest}"
    outside = f"torch 2.8.1 is outside the tested {tested_range.tested_range()}"
    assert str(tested_range.untested("2.8.1")).startswith(outside)
    newest = tested_range.release(tested_range.TESTED_TORCH[1])
    assert "outside" in str(tested_range.untested(f"{newest[0]}.{newest[1] + 1}.0"))
    assert "outside" not in str(tested_range.untested(tested_range.TESTED_TORCH[0]))


@pytest.fixture
def one_process_group():
    """A real gloo group of one process, in this process, with a known timeout."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))  # a read of a key never written fails soon
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=77)
    )
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_c10d_store_and_timeout_of_the_default_group(one_process_group):
    store = c10d.default_store()
    before = one_process_group.num_keys()
    store.set("written", "here")
    assert store.get("written") == b"here"
    assert one_process_group.num_keys() == before + 1  # written through to the group's own
    assert c10d.group_timeout(dist.group.WORLD) == timedelta(seconds=77)


def test_c10d_says_which_torch_when_the_store_getter_is_gone(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(internals.TorchInternalMissing) as raised:
        c10d.default_store()
    message = str(raised.value)
    assert "distributed_c10d._get_default_store" in message
    assert f"tested on {tested_range.tested_range()}" in message
    assert [api.name for api in internals.missing()] == ["distributed_c10d._get_default_store"]


def test_ddp_buckets_hooks_and_group_move(one_process_group):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    model(torch.randn(4, 3)).sum().backward()
    buckets = ddp.bucket_parameters(model)
    assert sorted(id(p) for bucket in buckets for p in bucket) == sorted(
        id(p) for p in model.parameters()
    )
    assert ddp.comm_hooks(model) == [] and ddp.builtin_comm_hook(model) == ""
    assert ddp.per_bucket_caps(model) == () and not ddp.delays_all_reduce(model)
    other = dist.new_group([0])
    assert ddp.update_process_group(model, other) and model.process_group is other
    ddp.remove_gradient_hooks(model)


def test_ddp_without_its_private_move_takes_the_rebuild_path(one_process_group, monkeypatch):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_update_process_group")
    assert not ddp.update_process_group(model, dist.new_group([0]))  # regroup rebuilds then
    monkeypatch.delattr(dist.Reducer, "_rebuild_buckets")
    assert ddp.bucket_parameters(model) is None  # a resume sums as DDP alone does


def test_mesh_flatten_and_the_error_before_anything_starts(one_process_group, monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from notebook_accel import ParallelismConfig

    whole = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh.flatten(whole[("dp_shard", "cp")], "dp_shard_cp")
    assert flat.mesh_dim_names == ("dp_shard_cp",) and flat.size() == 1
    monkeypatch.delattr(DeviceMesh, "_flatten")
    with pytest.raises(internals.TorchInternalMissing, match=re.escape("DeviceMesh._flatten")):
        ParallelismConfig(dp_shard_size=2)  # refused where it is made, not in a worker


def test_context_parallel_rotation_and_the_error_before_anything_starts(monkeypatch):
    from torch.distributed.tensor.experimental import _attention

    from notebook_accel import ParallelismConfig

    before = context_parallel.rotate_method()
    try:
        for strategy in ("alltoall", "allgather", "alltoall"):
            context_parallel.set_rotate_method(strategy)
            assert context_parallel.rotate_method() == strategy
    finally:
        context_parallel.set_rotate_method(before)
    monkeypatch.delattr(_attention, "set_rotate_method")
    with pytest.raises(internals.TorchInternalMissing, match="_attention.set_rotate_method"):
        ParallelismConfig(cp_size=2)  # refused where it is made, not in a worker
    assert [api.name for api in internals.missing()] == [context_parallel.APIS[0].name]


def test_cuda_lazy_start_and_count_without_starting_it():
    assert isinstance(cuda.is_compiled(), bool)
    assert isinstance(cuda.device_count_nvml(), int)
    original = cuda.lazy_init(torch.cuda)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    cuda.replace_lazy_init(torch.cuda, counted)
    try:
        assert cuda.lazy_init(torch.cuda) is counted
    finally:
        cuda.replace_lazy_init(torch.cuda, original)
    assert not torch.cuda.is_initialized()


def test_dynamo_wrapper_and_recompile_limit():
    module = torch.nn.Linear(2, 2)
    compiled = torch.compile(module)
    assert dynamo.compiled_class() is type(compiled)
    assert dynamo.original_module(compiled) is module
    assert dynamo.wrapped_module(compiled) is module
    other = torch.nn.Linear(2, 2)
    again = dynamo.compiled_like(compiled, other)
    assert isinstance(again, type(compiled)) and dynamo.wrapped_module(again) is other
    dynamo.set_wrapped_module(again, module)
    assert dynamo.original_module(again) is module
    config = importlib.import_module("torch._dynamo").config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    try:
        dynamo.raise_recompile_limit(before + 3)
        assert getattr(config, name) == before + 3
        dynamo.raise_recompile_limit(1)  # never lowered
        assert getattr(config, name) == before + 3
    finally:
        setattr(config, name, before)


def test_tensor_helpers():
    assert tensors.to_device("cpu") == torch.device("cpu")
    assert tensors.to_device(torch.float16) is None
    tree = {"a": torch.ones(2), "b": [torch.zeros(1), 3]}
    mapped = tensors.tree_map_only(torch.Tensor, lambda t: t + 1, tree)
    assert mapped["a"].tolist() == [2.0, 2.0] and mapped["b"][0].item() == 1.0
    assert mapped["b"][1] == 3
