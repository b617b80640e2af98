"""Warm launches: the kernel imports what the workers had to import, never while a
launch ends and never what could start a device, and no fork copies a half-done import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from notebook_accel import last_run, notebook_launcher
from notebook_accel.launch import warm
from notebook_accel.launch.options import ENV_START_METHOD, OPTIONS, LaunchConfig
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.platforms import GpuInfo, Hardware, LaunchRefused

TWO_GPUS = Hardware(gpus=(GpuInfo(0, "H200", capability=(9, 0)), GpuInfo(1)), cpu_cores=2)


@pytest.fixture
def warmer(monkeypatch):
    """Warming state of this test's own: one that stopped must not stop the next test's."""
    fresh = warm._ProcessWarming()
    monkeypatch.setattr(warm, "_PROCESS", fresh)
    return fresh


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """Write modules into a directory on sys.path; `installed=True` makes them count
    as installed packages. They leave sys.modules when the test ends."""
    site = tmp_path / "site-packages"
    notebook = tmp_path / "notebook"
    for directory in (site, notebook):
        directory.mkdir()
        monkeypatch.syspath_prepend(str(directory))
    roots = warm.installed_roots()
    monkeypatch.setattr(warm, "installed_roots", lambda: (*roots, str(site) + "/"))
    written: list[str] = []

    def write(name: str, source: str, installed: bool = False) -> str:
        path = (site if installed else notebook) / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        written.append(name)
        return str(path)

    yield write
    for name in list(sys.modules):
        if name.split(".")[0] in {n.split(".")[0] for n in written}:
            del sys.modules[name]


def import_each(*names: str) -> int:
    import importlib

    for name in names:
        importlib.import_module(name)
    return os.getpid()


def launch_importing(*names: str) -> list[int]:
    return notebook_launcher(
        import_each, args=names, num_processes=2, backend="cpu", live=False, return_all=True
    )


def next_launch_warming():
    """Launch again: outside a kernel, a launch first imports what the last one queued."""
    launch_importing()
    return last_run().warming


LAUNCH_LOOP = """
import json, sys
assert "torch._dynamo" not in sys.modules
from notebook_accel import Accelerator, last_run, notebook_launcher

def train():
    import sys, torch
    found = "torch._dynamo" in sys.modules
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return found

seen = []
for launch in range(3):  # a sweep in one cell: no pause between launches
    found = notebook_launcher(train, num_processes=2, backend="cpu", live=False)
    warming = last_run().warming
    seen.append({
        "found": found, "status": warming.status, "modules": warming.modules,
        "imported": warming.imported, "seconds": warming.seconds,
        "kernel_has_it": "torch._dynamo" in sys.modules,
    })
print(json.dumps(seen))
"""


def test_a_loop_of_launches_is_warm_from_the_second_with_no_pause():
    # A fresh interpreter: this one may have built an optimizer already.
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH_LOOP], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    first, second, third = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["found"] is False  # the first launch's workers imported torch._dynamo themselves
    # ... and the launch returned as soon as they ended, leaving the import queued
    assert first["status"] == "next launch" and first["modules"] == []
    assert first["seconds"] == 0 and first["kernel_has_it"] is False
    # the second imported it before starting its workers, which then had it
    assert second["found"] is True and second["status"] == "done"
    assert any(name.startswith("torch._dynamo") for name in second["modules"])
    assert second["imported"] > 100 and second["seconds"] > 0
    assert third["found"] is True and third["modules"] == []


def test_a_device_package_is_skipped_before_it_is_imported(warmer, stand_ins, tmp_path):
    marker = tmp_path / "imported_by"
    # A stand-in for a GPU library: importing it is what would start a device.
    stand_ins(
        "pycuda.__init__",
        f"import os\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')",
        installed=True,
    )
    stand_ins("next_to_the_notebook", "VALUE = 1")
    stand_ins("plain_library", "VALUE = 2", installed=True)

    workers = launch_importing("pycuda", "next_to_the_notebook", "plain_library")
    warming = last_run().warming
    assert warming.status == "next launch" and "plain_library" not in sys.modules
    following = next_launch_warming()

    assert "pycuda" not in sys.modules
    assert sorted(int(pid) for pid in marker.read_text().split()) == sorted(workers)
    assert warming.skipped["pycuda"].startswith("a device package")
    assert "next_to_the_notebook" not in sys.modules
    assert warming.skipped["next_to_the_notebook"].startswith("not an installed package")
    assert following.modules == ["plain_library"] and "plain_library" in sys.modules
    assert warming.status == following.status == "done"


def test_a_module_that_would_start_cuda_is_stopped_before_it_does(warmer, stand_ins):
    # What a GPU library does at import: start CUDA. This torch has none, so in
    # the workers it fails harmlessly; in the kernel warming must stop it first.
    stand_ins(
        "starts_cuda",
        """
        import torch
        try:
            torch.cuda._lazy_init()
        except AssertionError:  # torch without CUDA
            pass
        """,
        installed=True,
    )
    stand_ins("after_it", "VALUE = 3", installed=True)
    unguarded = torch.cuda._lazy_init
    launch_importing("starts_cuda", "after_it")
    warming = next_launch_warming()

    assert "would initialise CUDA" in warming.skipped["starts_cuda"]
    assert "starts_cuda" not in sys.modules and not torch.cuda.is_initialized()
    assert warming.modules == ["after_it"] and warming.status == "done"
    assert torch.cuda._lazy_init is unguarded  # the guard is gone again


def test_warming_stops_if_a_device_started_anyway_and_gpu_launches_start_fresh(
    warmer, stand_ins, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "_initialized", False)  # restored after the test
    # Starts "CUDA" past the guard: detected after the import, not prevented.
    stand_ins("sneaks_cuda", "import torch\ntorch.cuda._initialized = True", installed=True)
    stand_ins("never_reached", "VALUE = 4", installed=True)
    torch.cuda._initialized = False
    launch_importing("sneaks_cuda", "never_reached")
    queued = last_run().warming
    warming = next_launch_warming()

    assert warming.status == queued.status == "stopped"
    assert "importing sneaks_cuda" in warming.problem
    assert "never_reached" not in sys.modules
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    plan = plan_launch(function=import_each, num_processes=2, backend="cuda", hardware=TWO_GPUS)
    assert plan.start_method == "forkserver" and "CUDA is already initialised" in (
        plan.fresh_start_reason
    )
    # and warming stays off in this process
    launch_importing("never_reached")
    assert last_run().warming.status == "off" and "sneaks_cuda" in last_run().warming.problem


def test_a_kernel_that_initialised_cuda_before_still_cannot_fork_gpu_workers(warmer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # a cell touched a GPU
    launch_importing("json")  # CPU workers may still run
    with pytest.raises(LaunchRefused, match="start_method='fork' cannot work here"):
        plan_launch(
            function=import_each,
            num_processes=2,
            backend="cuda",
            hardware=TWO_GPUS,
            start_method="fork",
        )


def test_warm_false_turns_it_off(warmer):
    launch = notebook_launcher(
        import_each, args=("json",), num_processes=2, backend="cpu", live=False, warm=False
    )
    assert launch
    assert last_run().warming.status == "off" and last_run().imported_by_workers == {}


def test_the_option_reaches_the_file_and_the_command_line():
    assert "warm: false" in LaunchConfig(warm=False).to_yaml()
    assert LaunchConfig.from_yaml("warm: false").warm is False
    assert OPTIONS["warm"].parse("no") is False and OPTIONS["warm"].parse("true") is True


def test_choose_decides_from_names_and_files_alone():
    torch_dir = os.path.dirname(torch.__file__)
    names, skipped = warm.choose(
        {
            "__ipython_cell__": None,
            "triton.language": f"{torch_dir}/../triton/language/__init__.py",
            "triton.runtime": f"{torch_dir}/../triton/runtime/__init__.py",
            "torch_xla.core": f"{torch_dir}/../torch_xla/core/__init__.py",
            "made_at_run_time": None,
            "a_real_library": f"{torch_dir}/../a_real_library/__init__.py",
            "json": None,  # imported already: nothing to say
        }
    )
    assert names == ["a_real_library"]
    assert skipped["__ipython_cell__"] == "the notebook's own code"
    assert skipped["triton"].startswith("a device package") and "triton.runtime" not in skipped
    assert skipped["torch_xla"].startswith("a device package")
    assert skipped["made_at_run_time"].startswith("no file")


def test_a_panel_shown_outside_a_kernel_warms_nothing(warmer, stand_ins, monkeypatch):
    # In a kernel it leaves the imports to the kernel's event loop, between cells
    # (tests/notebooks/test_warm_in_kernel.py); elsewhere no thread may import them.
    from notebook_accel.ui.panel import LaunchPanel

    stand_ins("heavy_stand_in", "VALUE = 1", installed=True)
    monkeypatch.setattr(warm, "KNOWN_HEAVY", ("heavy_stand_in",))
    panel = LaunchPanel(import_each, hardware=Hardware(cpu_cores=2))
    panel._repr_mimebundle_()
    assert panel.warming is not None and panel.warming.wait(1)
    assert panel.warming.status == "off" and "main one" in panel.warming.problem
    assert "heavy_stand_in" not in sys.modules


WORKER_CODE_PROBE = """
import json, sys
from notebook_accel import notebook_launcher  # what a kernel has before its first launch

def barrier():
    import sys
    before = set(sys.modules)
    from notebook_accel import Accelerator

    Accelerator().wait_for_everyone()
    return sorted(name for name in set(sys.modules) - before if "notebook_accel" in name)

print(json.dumps([
    notebook_launcher(barrier, num_processes=2, backend="cpu", warm=False) for _ in range(2)
]))
"""


def test_even_with_warming_off_no_forked_worker_imports_the_accelerator_again():
    # A fresh interpreter, which has imported the launcher and not the Accelerator.
    done = subprocess.run(
        [sys.executable, "-c", WORKER_CODE_PROBE],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, ENV_START_METHOD: "fork"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[], []]
