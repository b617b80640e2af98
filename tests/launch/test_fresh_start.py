"""Workers in fresh interpreters: what only they do (the rest of this folder runs
under both start methods): arguments by value, GPU tensors, imports that fail."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from notebook_accel import WorkerError, last_run, notebook_launcher
from notebook_accel.config.settings import ENV_BACKEND
from notebook_accel.launch import fresh, packing


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU (this suite also runs without one)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


class OnGpuParameter(torch.nn.Parameter):
    """A parameter that says it is on a GPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def describe(batch, model):
    return {
        "batch": (type(batch).__name__, batch.device.type, batch.tolist()),
        "weight": (
            type(model.weight).__name__,
            model.weight.device.type,
            model.weight.requires_grad,
        ),
        "scale": (type(model.scale).__name__, model.scale.tolist()),
        "pid": os.getpid(),
    }


def test_gpu_tensors_in_the_arguments_reach_cpu_workers_on_the_cpu():
    model = torch.nn.Linear(2, 2)
    model.weight = OnGpuParameter(model.weight.detach().clone())
    model.register_buffer("scale", torch.full((2,), 3.0).as_subclass(OnGpu))
    batch = torch.arange(3.0).as_subclass(OnGpu)
    values = notebook_launcher(
        describe,
        args=(batch, model),
        num_processes=2,
        backend="cpu",
        start_method="spawn",
        return_all=True,
        live=False,
    )
    for value in values:
        assert value["batch"] == ("Tensor", "cpu", [0.0, 1.0, 2.0])
        assert value["weight"] == ("Parameter", "cpu", True)
        assert value["scale"] == ("Tensor", [3.0, 3.0])
        assert value["pid"] != os.getpid()
    assert last_run().start_method == "spawn"


def test_gpu_tensors_are_sent_as_cpu_copies_placed_by_each_worker():
    """The pickled bytes hold CPU copies and a call that places them on the worker's device."""
    gpu = torch.ones(2).as_subclass(OnGpu)
    blob = packing.pack(len, ({"x": gpu},), {})
    assert b"_on_worker_device" in blob
    code = textwrap.dedent(
        f"""
        import os, pickle, sys
        os.environ[{ENV_BACKEND!r}] = "cpu"
        payload, sources, changed = pickle.loads(sys.stdin.buffer.read())
        value = pickle.loads(payload)[1][0]["x"]
        print(type(value).__name__, value.device.type, value.tolist())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, timeout=60, check=True
    )
    assert done.stdout.decode().split() == ["Tensor", "cpu", "[1.0,", "1.0]"]


def test_a_function_whose_module_a_fresh_interpreter_cannot_import_is_a_clear_error(
    tmp_path, monkeypatch
):
    (tmp_path / "only_here.py").write_text("def train():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here  # noqa: PLC0415 - importable here, not in the worker

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.delitem(sys.modules, "only_here")
    sys.modules["only_here"] = only_here  # still imported here, no longer on the path
    try:
        with pytest.raises(WorkerError) as failure:
            notebook_launcher(
                only_here.train, num_processes=2, backend="cpu", start_method="spawn", live=False
            )
    finally:
        del sys.modules["only_here"]
    text = str(failure.value)
    assert "could not load the function or its arguments" in text
    assert "ModuleNotFoundError" in text and "only_here" in text


def test_a_spawn_start_reports_no_modules_to_warm():
    # A fresh interpreter imports what it needs itself: nothing here would help it.
    notebook_launcher(len, args=([],), num_processes=2, backend="cpu", start_method="spawn")
    assert last_run().imported_by_workers == {}
    assert last_run().start_method == "spawn"


def test_the_shipped_spec_is_one_in_memory_file_read_by_every_worker():
    from notebook_accel.launch.preflight import plan_launch

    plan = plan_launch(
        function=describe, args=(1, 2), num_processes=2, backend="cpu", start_method="spawn"
    )
    fd = fresh.ship(plan.worker_spec(port=1234, attempt=0))
    try:
        spec = pickle.loads(fresh.read_all(fd))
    finally:
        os.close(fd)
    assert spec.function is None and spec.start_method == "spawn"
    function, args, kwargs = spec.unpacked().function, spec.unpacked().args, spec.unpacked().kwargs
    assert (function, args, kwargs) == (describe, (1, 2), {})
