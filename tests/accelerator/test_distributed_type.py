"""`distributed_type` says FSDP while an FSDP plugin shards the models, as in Accelerate."""

from __future__ import annotations

from notebook_accel import (
    Accelerator,
    AcceleratorState,
    DistributedType,
    PartialState,
    notebook_launcher,
)
from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin


def report():
    """What each Accelerator of a worker and the shared states say, in turn."""
    seen = {"plain": str(Accelerator().distributed_type)}
    sharding = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    seen["fsdp"] = str(sharding.distributed_type)
    seen["fsdp_state"] = str(AcceleratorState().distributed_type)  # no argument: unchanged
    seen["partial"] = str(PartialState().distributed_type)  # the processes, not the models
    seen["plain_again"] = str(Accelerator().distributed_type)
    return seen


def test_two_workers_report_fsdp_with_a_plugin_and_their_platform_without():
    results = notebook_launcher(report, num_processes=2, backend="cpu", return_all=True)
    expected = {
        "plain": "MULTI_CPU",
        "fsdp": "FSDP",
        "fsdp_state": "FSDP",
        "partial": "MULTI_CPU",
        "plain_again": "MULTI_CPU",
    }
    assert results == [expected, expected]


def launch_settings_report():
    return str(Accelerator().distributed_type)


def test_a_launch_with_fsdp_settings_reports_fsdp():
    results = notebook_launcher(
        launch_settings_report, num_processes=2, backend="cpu", fsdp={}, return_all=True
    )
    assert results == ["FSDP", "FSDP"]


def test_one_process_with_a_plugin_is_not_distributed():
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    assert accelerator.distributed_type == DistributedType.NO
