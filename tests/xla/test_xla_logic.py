"""The XLA backend's logic on any machine: TPU detection, preflight, backend choice.

Machines are described by fake environments and fake /sys and /dev trees;
torch_xla is not needed (and not installed in the main environment). The real
launch on XLA's CPU device is test_xla_cpu_device.py.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from notebook_accel import platforms
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.platforms import Hardware, LaunchRefused, XlaInfo
from notebook_accel.platforms.xla import detect_xla

REPO = Path(__file__).resolve().parents[2]

V3_8 = Hardware(tpu_cores=8, xla=XlaInfo("TPU", 4, 2, "v3-8", "kaggle"), cpu_cores=96)
V5E_8 = Hardware(tpu_cores=8, xla=XlaInfo("TPU", 8, 1, "v5litepod-8", "tpu-vm"), cpu_cores=224)
XLA_CPU = Hardware(xla=XlaInfo("CPU", 1, 1), cpu_cores=2)
XLA_CPU_2 = Hardware(xla=XlaInfo("CPU", 1, 2), cpu_cores=2)
NO_TPU = Hardware(cpu_cores=2)


def train():
    raise AssertionError("must never run")


def no_modules(name: str) -> bool:
    return False


def libtpu_only(name: str) -> bool:
    return name == "libtpu"


def fake_pci(root: Path, device_id: str, chips: int) -> None:
    for index in range(chips):
        folder = root / "sys/bus/pci/devices" / f"0000:00:{index + 4:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text("0x1ae0\n")
        (folder / "device").write_text(f"{device_id}\n")
    other = root / "sys/bus/pci/devices/0000:00:01.0"  # a network card, say
    other.mkdir(parents=True)
    (other / "vendor").write_text("0x1af4\n")
    (other / "device").write_text("0x1000\n")


def fake_devices(root: Path, pattern: str, count: int) -> None:
    for index in range(count):
        path = root / pattern.format(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


# -- detection -----------------------------------------------------------------------


def test_tpu_v5e_vm_from_pci_ids(tmp_path):
    fake_pci(tmp_path, "0x0063", 8)
    info = detect_xla({}, str(tmp_path), libtpu_only)
    assert info == XlaInfo("TPU", 8, 1, "", "tpu-vm", "")
    assert info.devices == 8


def test_kaggle_v3_8_has_two_cores_per_chip(tmp_path):
    fake_pci(tmp_path, "0x0027", 4)
    env = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_ACCELERATOR_TYPE": "v3-8"}
    info = detect_xla(env, str(tmp_path), libtpu_only)
    assert (info.processes, info.devices_per_process, info.devices) == (4, 2, 8)
    assert (info.platform, info.accelerator_type) == ("kaggle", "v3-8")


def test_colab_v2_8_from_accel_device_files(tmp_path):
    fake_devices(tmp_path, "dev/accel{}", 4)
    env = {"COLAB_RELEASE_TAG": "release-colab_20250101", "TPU_ACCELERATOR_TYPE": "v2-8"}
    info = detect_xla(env, str(tmp_path), libtpu_only)
    assert (info.platform, info.processes, info.devices) == ("colab", 4, 8)


def test_colab_v5e_1_from_vfio_device_files(tmp_path):
    fake_devices(tmp_path, "dev/vfio/{}", 1)
    (tmp_path / "dev/vfio/vfio").touch()  # the VFIO container, not a chip
    env = {"COLAB_RELEASE_TAG": "release-colab_20250101", "TPU_ACCELERATOR_TYPE": "v5litepod-1"}
    info = detect_xla(env, str(tmp_path), libtpu_only)
    assert (info.platform, info.processes, info.devices) == ("colab", 1, 1)


def test_vfio_devices_alone_are_not_taken_for_tpus(tmp_path):
    fake_devices(tmp_path, "dev/vfio/{}", 2)  # say, GPUs passed through to a VM
    assert detect_xla({}, str(tmp_path), libtpu_only) is None


def test_no_tpu_and_other_pjrt_devices(tmp_path):
    assert detect_xla({}, str(tmp_path), libtpu_only) is None
    fake_pci(tmp_path, "0x0063", 4)
    assert detect_xla({"PJRT_DEVICE": "CUDA"}, str(tmp_path), libtpu_only) is None


def test_pjrt_cpu_device(tmp_path):
    assert detect_xla({"PJRT_DEVICE": "CPU"}, str(tmp_path)) == XlaInfo("CPU", 1, 1)
    info = detect_xla({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, str(tmp_path))
    assert (info.processes, info.devices) == (1, 4)


def test_process_bounds_limit_the_processes(tmp_path):
    fake_pci(tmp_path, "0x0063", 8)
    info = detect_xla({"TPU_PROCESS_BOUNDS": "1,1,1"}, str(tmp_path), libtpu_only)
    assert (info.processes, info.devices) == (1, 1)


def test_missing_libtpu_is_reported(tmp_path):
    fake_pci(tmp_path, "0x006f", 4)
    assert "libtpu" in detect_xla({}, str(tmp_path), no_modules).missing
    env = {"TPU_LIBRARY_PATH": "/opt/libtpu.so"}
    assert detect_xla(env, str(tmp_path), no_modules).missing == ""


def test_detect_reports_tpu_cores_and_prefers_xla(monkeypatch):
    monkeypatch.setattr(platforms, "detect_xla", lambda environ: XlaInfo("TPU", 4, 2))
    found = platforms.detect_hardware()
    assert found.tpu_cores == 8 and found.accelerator == "xla"
    assert platforms.offered_platforms(found)[0] == "xla"
    monkeypatch.setattr(platforms, "detect_xla", lambda environ: XlaInfo("CPU", 1, 1))
    found = platforms.detect_hardware()
    assert found.accelerator == "cpu"  # XLA's CPU device only when asked for


# -- preflight -----------------------------------------------------------------------


@pytest.fixture
def torch_xla_installed(monkeypatch):
    """A stand-in torch_xla module whose runtime has not started."""
    module = types.ModuleType("torch_xla")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_xla", None)
    module._XLAC = types.SimpleNamespace(_xla_runtime_is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch_xla", module)
    return module


def test_all_cores_one_process_per_chip(torch_xla_installed):
    plan = plan_launch(function=train, hardware=V3_8)
    assert plan.platform.name == "xla"
    assert plan.local_world_size == 4  # two cores per v3 chip, one process each chip
    assert not plan.in_process
    plan = plan_launch(function=train, hardware=V5E_8, num_processes=8)
    assert plan.local_world_size == 8
    assert plan.worker_spec(port=1, attempt=0).run == plan.platform.run_in_worker


def test_one_core_is_forked_too(torch_xla_installed):
    plan = plan_launch(function=train, hardware=V5E_8, num_processes=1)
    assert plan.local_world_size == 1 and not plan.in_process
    plan = plan_launch(function=train, hardware=XLA_CPU, backend="xla")
    assert plan.local_world_size == 1 and not plan.in_process


@pytest.mark.parametrize(
    ("hardware_", "options", "error", "message"),
    [
        (V5E_8, {"num_processes": 4}, ValueError, "Pass num_processes=8 or 1"),
        (V5E_8, {"num_processes": 16}, ValueError, "but this machine has 8"),
        (V5E_8, {"mixed_precision": "fp16"}, ValueError, "use mixed_precision='bf16'"),
        (V5E_8, {"mixed_precision": "fp8"}, ValueError, "fp8 needs a CUDA GPU"),
        (V5E_8, {"num_nodes": 2}, ValueError, "runs on one machine"),
        (V5E_8, {"backend": "xla", "devices": [0]}, ValueError, "devices= chooses GPUs"),
        (XLA_CPU_2, {"backend": "xla", "num_processes": 2}, ValueError, "collectives deadlock"),
        (NO_TPU, {"backend": "xla"}, RuntimeError, "set PJRT_DEVICE=CPU"),
    ],
)
def test_refusals(torch_xla_installed, hardware_, options, error, message):
    with pytest.raises(error, match=message):
        plan_launch(function=train, hardware=hardware_, **options)


def test_colab_tpu_node_is_explained(monkeypatch):
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    with pytest.raises(RuntimeError, match="TPU Node"):
        plan_launch(function=train, hardware=NO_TPU, backend="xla")


def test_missing_libtpu_is_refused(torch_xla_installed):
    machine = Hardware(tpu_cores=4, xla=XlaInfo("TPU", 4, 1, missing="libtpu (pip install x)"))
    with pytest.raises(RuntimeError, match=r"not libtpu \(pip install x\)"):
        plan_launch(function=train, hardware=machine)


def test_refused_once_the_runtime_started_in_this_process(torch_xla_installed):
    torch_xla_installed._XLAC._xla_runtime_is_initialized = lambda: True
    # Not even fresh interpreters could open the TPU this process holds.
    for start_method in ("auto", "spawn", "fork"):
        with pytest.raises(LaunchRefused, match="XLA runtime is already initialised") as refused:
            plan_launch(function=train, hardware=V5E_8, start_method=start_method)
        assert "Restart the kernel" in str(refused.value) or "restart the kernel" in str(
            refused.value
        )


def test_missing_torch_xla_says_how_to_install():
    assert "torch_xla" not in sys.modules
    with pytest.raises(ImportError, match=r'pip install "notebook-accel\[xla\]"'):
        plan_launch(function=train, hardware=V5E_8)


def test_accelerator_without_torch_xla_says_how_to_install(monkeypatch):
    from notebook_accel import Accelerator

    monkeypatch.setenv("NOTEBOOK_ACCEL_BACKEND", "xla")
    with pytest.raises(ImportError, match=r'pip install "notebook-accel\[xla\]"'):
        Accelerator()


def test_nothing_imports_torch_xla_before_the_fork(tmp_path):
    """Detection and the whole XLA preflight run without importing torch_xla."""
    package = tmp_path / "torch_xla"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('torch_xla was imported')\n")
    script = textwrap.dedent(
        """
        import sys
        from notebook_accel.platforms import Hardware, XlaInfo, detect_hardware
        from notebook_accel.launch.preflight import plan_launch
        detect_hardware()
        machine = Hardware(tpu_cores=8, xla=XlaInfo("TPU", 8, 1))
        plan = plan_launch(function=print, hardware=machine, num_processes=8)
        assert plan.platform.name == "xla"
        plan_launch(function=print, hardware=machine, backend="cpu", num_processes=2)
        assert "torch_xla" not in sys.modules, "torch_xla was imported"
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PJRT_DEVICE": "TPU"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert done.stdout.strip() == "ok", done.stderr
