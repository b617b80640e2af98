"""Bad input is refused before anything starts, with an error that says what to do."""

from __future__ import annotations

import socket
import sys
import warnings

import pytest
import torch

from notebook_accel import notebook_launcher, platforms
from notebook_accel.launch import preflight
from notebook_accel.launch.launcher import fresh_start_message
from notebook_accel.launch.options import ENV_START_METHOD
from notebook_accel.launch.preflight import held_device_types, plan_launch
from notebook_accel.platforms import GpuInfo, Hardware, LaunchRefused, cuda, cuda_origin
from notebook_accel.platforms.cuda_origin import CudaOrigin
from tests_support import live_children

CPU_ONLY = Hardware(gpus=(), cpu_cores=2, ram_bytes=1 << 30)
TWO_T4 = Hardware(
    gpus=(GpuInfo(0, "Tesla T4", 16 << 30, (7, 5)), GpuInfo(1, "Tesla T4", 16 << 30, (7, 5))),
    cpu_cores=4,
)
TWO_H100 = Hardware(
    gpus=(GpuInfo(0, "H100", 80 << 30, (9, 0)), GpuInfo(1, "H100", 80 << 30, (9, 0))), cpu_cores=8
)


def train(lr, epochs=1):
    raise AssertionError("must never run: the launch should have been refused")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"num_processes": 0}, ValueError, "num_processes=0 must be at least 1"),
        ({"num_processes": 2.0}, TypeError, "num_processes must be a whole number"),
        ({"num_processes": True}, TypeError, "num_processes must be a whole number"),
        ({"args": ()}, TypeError, r"train\(lr, epochs=1\) cannot be called with args=\(\)"),
        ({"args": (1, 2, 3)}, TypeError, "too many positional arguments"),
        ({"args": 0.1}, TypeError, r"for a single argument write args=\(value,\)"),
        ({"kwargs": {"lr2": 1}}, TypeError, "unexpected keyword argument 'lr2'"),
        ({"mixed_precision": "fp64"}, ValueError, "choose one of no, fp16, bf16, fp8"),
        ({"mixed_precision": "fp8"}, ValueError, "fp8 needs a CUDA GPU"),
        ({"num_procs": 2}, TypeError, "unknown option 'num_procs'. Did you mean 'num_processes'"),
        ({"backend": "tpuu"}, ValueError, "backend='tpuu' is no device type torch knows here"),
        ({"gradient_accumulation_steps": 0}, ValueError, "must be at least 1"),
        ({"node_rank": 2, "num_nodes": 2}, ValueError, "node_rank=2 must be below num_nodes=2"),
        ({"use_port": "http"}, ValueError, "use_port='http' must be a port number"),
        ({"use_port": 70000}, ValueError, "between 1 and 65535"),
        ({"timeout": -1}, ValueError, "timeout=-1 must be a positive number"),
        ({"output": "rank0"}, ValueError, "output='rank0' must be one of all, main, none"),
        ({"num_processes": 1, "timeout": 5}, ValueError, "timeout= needs worker processes"),
        ({"max_restarts": 1, "num_nodes": 2}, ValueError, "max_restarts works on one machine"),
        ({"devices": [0], "num_processes": None}, ValueError, "devices= chooses accelerator"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(options, error, message):
    # CPU workers, asked for: the same refusals on a machine with GPUs.
    call = {"args": (0.1,), "num_processes": 2, "backend": "cpu", **options}
    with pytest.raises(error, match=message):
        notebook_launcher(train, **call)
    assert live_children() == []


def test_accelerate_only_options_at_their_defaults_are_accepted():
    result = notebook_launcher(
        lambda: "ok", num_processes=1, rdzv_backend="static", rdzv_id="none", monitor_interval=0.1
    )
    assert result == "ok"


def test_accelerate_only_options_elsewhere_are_accepted_with_one_warning(monkeypatch):
    from notebook_accel.launch import options

    monkeypatch.setattr(options, "_warned_ignored", set())
    with pytest.warns(UserWarning, match="ignores rdzv_backend='c10d'"):
        assert notebook_launcher(lambda: "ok", num_processes=1, rdzv_backend="c10d") == "ok"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once, not at every launch
        assert notebook_launcher(lambda: "ok", num_processes=1, rdzv_backend="c10d") == "ok"


def test_a_busy_explicit_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1 port {port} .*in use"):
            notebook_launcher(train, args=(0.1,), num_processes=2, use_port=port, backend="cpu")
    assert live_children() == []


def test_more_gpu_workers_than_gpus_is_refused():
    with pytest.raises(ValueError, match="has 2. Pass num_processes=2 or fewer"):
        plan_launch(function=train, args=(0.1,), num_processes=4, hardware=TWO_T4)


def test_more_cpu_workers_than_cores_only_warns():
    with pytest.warns(UserWarning, match="the workers will share them"):
        plan = plan_launch(function=train, args=(0.1,), num_processes=3, hardware=CPU_ONLY)
    assert plan.world_size == 3 and plan.platform.name == "cpu"


def test_default_worker_counts_follow_the_hardware(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: False)
    assert plan_launch(function=train, args=(0.1,), hardware=CPU_ONLY).world_size == 2
    gpu_plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4)
    assert gpu_plan.platform.name == "cuda" and gpu_plan.world_size == 2
    assert gpu_plan.platform.process_group_backend == "nccl"
    cpu_plan = plan_launch(function=train, args=(0.1,), backend="cpu", hardware=TWO_T4)
    assert cpu_plan.platform.name == "cpu"


def test_precision_is_checked_against_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: False)
    with pytest.raises(ValueError, match="bf16 needs compute capability 8.0"):
        plan_launch(function=train, args=(0.1,), mixed_precision="bf16", hardware=TWO_T4)
    with pytest.raises(ValueError, match="fp8 needs compute capability 8.9"):
        plan_launch(function=train, args=(0.1,), mixed_precision="fp8", hardware=TWO_T4)
    plan = plan_launch(function=train, args=(0.1,), mixed_precision="bf16", hardware=TWO_H100)
    assert plan.settings.mixed_precision == "bf16"


def test_devices_choose_gpus_through_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: False)
    plan = plan_launch(function=train, args=(0.1,), devices=[1], hardware=TWO_T4)
    assert plan.world_size == 1 and plan.platform.name == "cuda"
    assert plan.platform.worker_environment(0, plan.devices) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert not plan.in_process  # GPU 1 needs a worker of its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the kernel sees two of four GPUs
    assert plan.platform.worker_environment(0, plan.devices) == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match="does not match devices"):
        plan_launch(function=train, args=(0.1,), devices=[0, 1], num_processes=1, hardware=TWO_T4)


def test_cuda_initialised_in_the_kernel_means_fresh_interpreters_naming_the_culprit(monkeypatch):
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    culprit = CudaOrigin("bitsandbytes", "bitsandbytes/cextension.py:12", "cell In[3], line 2")
    monkeypatch.setattr(cuda_origin, "_origin", culprit)
    plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4)
    assert plan.start_method == "forkserver"
    assert "CUDA is already initialised" in plan.fresh_start_reason
    assert "by bitsandbytes (bitsandbytes/cextension.py:12), from cell In[3], line 2" in (
        plan.fresh_start_reason
    )
    message = fresh_start_message(plan)
    assert "restart the kernel" in message and "start_method='forkserver'" in message
    assert "first such launch is about 1.5-2 s slower" in message
    # Asking for a fork there is refused before anything starts, with both ways out.
    with pytest.raises(LaunchRefused, match="start_method='fork' cannot work here") as refused:
        plan_launch(function=train, args=(0.1,), hardware=TWO_T4, start_method="fork")
    assert "cell In[3], line 2" in str(refused.value)
    assert "restart the kernel" in str(refused.value)


def test_a_clean_kernel_forks_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: False)
    plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4)
    assert (plan.start_method, plan.fresh_start_reason) == ("fork", None)
    plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4, start_method="spawn")
    assert (plan.start_method, plan.fresh_start_reason) == ("spawn", None)
    plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4, start_method="forkserver")
    assert (plan.start_method, plan.fresh_start_reason) == ("forkserver", None)
    monkeypatch.setenv(ENV_START_METHOD, "spawn")
    assert plan_launch(function=train, args=(0.1,), hardware=TWO_T4).start_method == "spawn"
    monkeypatch.setenv(ENV_START_METHOD, "vfork")
    with pytest.raises(ValueError, match="NOTEBOOK_ACCEL_START_METHOD='vfork' must be one of"):
        plan_launch(function=train, args=(0.1,), hardware=TWO_T4)
    with pytest.raises(ValueError, match="start_method='threads' must be one of auto"):
        plan_launch(function=train, args=(0.1,), hardware=TWO_T4, start_method="threads")


def test_a_cuda_driver_initialised_by_another_library_means_fresh_interpreters(monkeypatch):
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "_cuda_driver_initialised", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", sys)  # a loaded library that can start CUDA
    plan = plan_launch(function=train, args=(0.1,), hardware=TWO_T4)
    assert plan.start_method == "forkserver"
    assert "CUDA driver is already initialised" in plan.fresh_start_reason
    assert "loaded libraries that can do that: cupy" in plan.fresh_start_reason


def test_cpu_workers_given_gpu_tensors_start_fresh(monkeypatch):
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(preflight, "held_device_types", lambda value: {"cuda"})
    plan = plan_launch(function=train, args=(0.1,), backend="cpu", num_processes=2)
    assert plan.start_method == "forkserver" and "tensors on cuda" in plan.fresh_start_reason
    monkeypatch.setattr(preflight, "held_device_types", lambda value: set())
    plan = plan_launch(function=train, args=(0.1,), backend="cpu", num_processes=2)
    assert plan.start_method == "fork"


def test_gpu_tensors_are_found_in_containers_and_modules():
    cpu_only = {"model": torch.nn.Linear(2, 2), "data": [torch.ones(2), (1, "a")]}
    assert held_device_types(cpu_only) == set()
    meta = torch.nn.Linear(2, 2, device="meta")  # a device that is not a GPU either
    assert held_device_types((meta,)) == set()
    assert held_device_types(({"batch": [torch.ones(2).as_subclass(OnGpu)]},)) == {"cuda"}
    model = torch.nn.Linear(2, 2)
    model.register_buffer("scale", torch.ones(1).as_subclass(OnGpu))
    assert held_device_types(((model,), {})) == {"cuda"}


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU (this suite also runs without one)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_driver_probe_never_loads_libcuda_itself(monkeypatch):
    monkeypatch.setattr(cuda, "_library_loaded", lambda name: False)
    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda *a, **k: pytest.fail("loaded libcuda"))
    assert cuda._cuda_driver_initialised() is False


def test_gpu_counting_goes_through_nvml_not_the_cuda_runtime(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(
        torch._C,
        "_cuda_getDeviceCount",
        lambda: pytest.fail("the CUDA runtime was asked"),
        raising=False,
    )
    monkeypatch.setattr(cuda, "_nvml_gpus", lambda: ())
    assert cuda.cuda_device_count() == 2
    assert [gpu.index for gpu in platforms.detect_hardware().gpus] == [0, 1]


def test_gpus_that_nvml_cannot_count_are_counted_without_the_cuda_runtime(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # e.g. MIG UUIDs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("runtime fallback"))
    monkeypatch.setattr(
        torch._C,
        "_cuda_getDeviceCount",
        lambda: pytest.fail("the CUDA runtime was asked"),
        raising=False,
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4f2a,MIG-9c1e")
    assert cuda.cuda_device_count() == 2


def inner_launch():
    return notebook_launcher(lambda: 1, num_processes=2, backend="cpu")


def test_launching_from_inside_a_worker_is_refused():
    from notebook_accel import WorkerError

    with pytest.raises(WorkerError, match="called inside a launched worker"):
        notebook_launcher(inner_launch, num_processes=2, backend="cpu")


def test_detect_hardware_is_public_and_reads_this_machine_without_cuda():
    import notebook_accel

    hardware = notebook_accel.detect_hardware()
    assert isinstance(hardware, notebook_accel.Hardware)
    assert hardware.cpu_cores >= 1 and hardware.ram_bytes > 0
    assert not torch.cuda.is_initialized()


def test_devices_beyond_the_machine_s_gpus_are_named():
    with pytest.raises(ValueError, match="devices=\\[0\\] names GPU 0, but this machine has 0"):
        plan_launch(function=train, args=(0.1,), devices=[0], hardware=CPU_ONLY)


def test_far_more_cpu_workers_than_cores_is_refused_unless_forced():
    with pytest.raises(ValueError, match=r"nothing was started.*oversubscribe=True"):
        plan_launch(function=train, args=(0.1,), num_processes=10**6, hardware=CPU_ONLY)
    limit = 8 * CPU_ONLY.cpu_cores
    with pytest.warns(UserWarning, match="the workers will share them"):
        assert plan_launch(function=train, args=(0.1,), num_processes=limit, hardware=CPU_ONLY)
    with pytest.warns(UserWarning, match="the workers will share them"):
        plan = plan_launch(
            function=train,
            args=(0.1,),
            num_processes=limit + 1,
            oversubscribe=True,
            hardware=CPU_ONLY,
        )
    assert plan.world_size == limit + 1
