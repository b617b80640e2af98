"""Results come back from real gloo workers; settings reach them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from notebook_accel import last_run, notebook_launcher
from notebook_accel.config.settings import LaunchSettings
from tests_support import live_children

# Every test here runs with forked workers and with workers that get the function by
# value (tests/conftest.py says why not a third time under "spawn").
pytestmark = pytest.mark.usefixtures("each_way_to_ship")


def sum_of_ranks(scale: float, offset: float = 0.0):
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())]) * scale + offset
    dist.all_reduce(value)
    return {
        "sum": value,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": {
            name: os.environ[name]
            for name in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            )
        },
        "pid": os.getpid(),
    }


def test_two_workers_form_one_group_and_rank0_value_comes_back():
    result = notebook_launcher(sum_of_ranks, args=(2.0,), num_processes=2, backend="cpu")
    assert result["rank"] == 0 and result["world"] == 2
    assert torch.equal(result["sum"], torch.tensor([2.0]))  # (0 + 1) * 2
    assert result["env"]["WORLD_SIZE"] == "2" and result["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert result["pid"] != os.getpid()
    assert live_children() == []


def test_return_all_lists_every_rank_in_order_and_kwargs_reach_the_function():
    results = notebook_launcher(
        sum_of_ranks,
        args=(1.0,),
        kwargs={"offset": 10.0},
        num_processes=2,
        return_all=True,
        backend="cpu",
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["env"]["RANK"] for r in results] == ["0", "1"]
    assert all(torch.equal(r["sum"], torch.tensor([21.0])) for r in results)
    assert len({r["pid"] for r in results}) == 2
    assert last_run().status == "finished" and last_run().world_size == 2


def test_two_launches_back_to_back_pick_free_ports():
    first = notebook_launcher(sum_of_ranks, args=(1.0,), num_processes=2, backend="cpu")
    second = notebook_launcher(sum_of_ranks, args=(1.0,), num_processes=2, backend="cpu")
    assert first["sum"].item() == second["sum"].item() == 1.0
    assert first["env"]["MASTER_PORT"] != "29500"


def launch_settings_and_grad():
    settings = LaunchSettings.from_env()
    weight = torch.ones(3, requires_grad=True)
    return settings, weight * 2


def test_settings_reach_workers_and_tensors_come_back_detached():
    settings, tensor = notebook_launcher(
        launch_settings_and_grad,
        num_processes=2,
        mixed_precision="bf16",
        gradient_accumulation_steps=4,
        backend="cpu",
    )
    assert settings == LaunchSettings("cpu", "bf16", 4)
    assert not tensor.requires_grad and tensor.device.type == "cpu"


def in_process_probe():
    dist.init_process_group("gloo")
    return os.getpid(), os.environ["RANK"], dist.get_world_size()


def test_one_process_runs_in_the_calling_process_and_restores_everything():
    environ = dict(os.environ)
    pid, rank, world = notebook_launcher(in_process_probe, num_processes=1, backend="cpu")
    assert (pid, rank, world) == (os.getpid(), "0", 1)
    assert dict(os.environ) == environ
    assert not dist.is_initialized()


def test_in_process_errors_propagate_unwrapped_for_debuggers():
    def broken():
        raise KeyError("debug me")

    with pytest.raises(KeyError, match="debug me"):
        notebook_launcher(broken, num_processes=1, backend="cpu")


def parallel_matmul():
    x = torch.randn(400, 400)
    return float((x @ x).sum() * 0) + torch.get_num_threads()


def test_workers_finish_after_the_parent_ran_a_multithreaded_op():
    # This would hang in a plain fork: the parent's OpenMP pool is gone in the
    # child. The timeout turns a regression into a failure, not a hang.
    torch.set_num_threads(2)
    x = torch.randn(1000, 1000)
    _ = x @ x
    results = notebook_launcher(
        parallel_matmul, num_processes=2, timeout=60, return_all=True, backend="cpu"
    )
    assert results == [1.0, 1.0]


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from notebook_accel import notebook_launcher

    def train(n):
        dist.init_process_group("gloo")
        t = torch.tensor([float(n)])
        dist.all_reduce(t)
        print("worker", dist.get_rank(), "sum", t.item())
        return t.item()

    if __name__ == "__main__":
        print("result", notebook_launcher(train, args=(3,), num_processes=2, backend="cpu"))
""")


def test_same_call_works_from_a_plain_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "result 6.0" in lines
    assert "worker 0 sum 6.0" in lines and "[rank 1] worker 1 sum 6.0" in lines


def rank0_returns_nothing():
    import sys

    if os.environ["RANK"] == "0":
        sys.exit(0)
    return f"rank {os.environ['RANK']}"


def test_return_all_keeps_each_value_at_its_rank():
    assert notebook_launcher(
        rank0_returns_nothing, num_processes=2, return_all=True, live=False, backend="cpu"
    ) == [None, "rank 1"]


def returns_an_object_only_the_worker_can_rebuild():
    import sys
    import types

    module = types.ModuleType("made_in_the_worker")
    exec("class Result:\n    pass", module.__dict__)
    sys.modules["made_in_the_worker"] = module
    module.Result.__module__ = "made_in_the_worker"
    return module.Result()


def test_a_result_the_kernel_cannot_unpickle_is_a_worker_error():
    from notebook_accel import WorkerError

    with pytest.raises(WorkerError, match="could not read what the worker sent back"):
        notebook_launcher(
            returns_an_object_only_the_worker_can_rebuild,
            num_processes=2,
            live=False,
            backend="cpu",
        )
    assert live_children() == []
