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

from notebook_accel.launch import preflight
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.platforms import Hardware, LaunchRefused, XlaInfo, registry
from notebook_accel.platforms.xla import describe_tpu, detect_xla, install_command

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


ACCEL_CHIPS = {"0x0027", "0x005e"}  # v2/v3 and v4 open through /dev/accelN


def fake_pci(root: Path, device_id: str, chips: int, given: int | None = None) -> None:
    """A host's TPU chips as sysfs and /dev show them: each chip a PCI device of
    vendor Google, opened through /dev/accelN (v2 to v4) or through its IOMMU
    group's /dev/vfio/N (v5e and later, tpu-info's chip_path). `given` chips
    have their device file, as in a container given some of the host's chips."""
    given = chips if given is None else given
    for index in range(chips):
        folder = root / "sys/bus/pci/devices" / f"0000:00:{index + 4:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text("0x1ae0\n")
        (folder / "device").write_text(f"{device_id}\n")
        group = root / "sys/kernel/iommu_groups" / str(index)
        group.mkdir(parents=True)
        (folder / "iommu_group").symlink_to(group)
        if index < given:
            chip_file = f"dev/accel{index}" if device_id in ACCEL_CHIPS else f"dev/vfio/{index}"
            fake_devices(root, chip_file, 1)
    if device_id not in ACCEL_CHIPS:
        fake_devices(root, "dev/vfio/vfio", 1)  # the VFIO container, not a chip
    other = root / "sys/bus/pci/devices/0000:00:01.0"  # a network card, say
    other.mkdir(parents=True)
    (other / "vendor").write_text("0x1af4\n")
    (other / "device").write_text("0x1000\n")


def fake_devices(root: Path, pattern: str, count: int) -> None:
    for index in range(count):
        path = root / pattern.format(index)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


# What the runtimes set, as their sessions show them. Colab's v5e-1: its
# TPU_CHIPS_PER_HOST_BOUNDS says 2,2,1 on a one-chip runtime, so chips are
# never counted from it. Kaggle's v5e-8: ISTPUVM and TPU_PROCESS_ADDRESSES come
# from its TPU image (Kaggle/docker-python, tpu/Dockerfile).
COLAB_V5E_1 = {
    "COLAB_RELEASE_TAG": "release-colab-external_20251020-060100_RC00",
    "COLAB_TPU_1VM": "1",
    "TPU_ACCELERATOR_TYPE": "v5e-1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "TPU_HOST_BOUNDS": "1,1,1",
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
}
KAGGLE_V5E_8 = {
    "KAGGLE_KERNEL_RUN_TYPE": "Interactive",
    "KAGGLE_URL_BASE": "https://www.kaggle.com",
    "ISTPUVM": "1",
    "PJRT_DEVICE": "TPU",
    "TPU_PROCESS_ADDRESSES": "local",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
    "TPU_HOST_BOUNDS": "1,1,1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
}


# -- detection -----------------------------------------------------------------------


def test_tpu_v5e_vm_from_pci_ids(tmp_path):
    fake_pci(tmp_path, "0x0063", 8)
    info = detect_xla({}, str(tmp_path), libtpu_only)
    assert info == XlaInfo("TPU", 8, 1, "", "tpu-vm", "", "v5e")
    assert info.devices == 8
    assert describe_tpu(info) == "this TPU VM has TPU v5e chips (8 chips, 1 core each)"


def test_kaggle_v3_8_has_two_cores_per_chip(tmp_path):
    fake_pci(tmp_path, "0x0027", 4)
    env = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_ACCELERATOR_TYPE": "v3-8"}
    info = detect_xla(env, str(tmp_path), libtpu_only)
    assert (info.processes, info.devices_per_process, info.devices) == (4, 2, 8)
    assert (info.platform, info.accelerator_type, info.chip) == ("kaggle", "v3-8", "v2/v3")


def test_colab_v2_8_from_accel_device_files(tmp_path):
    fake_devices(tmp_path, "dev/accel{}", 4)
    env = {"COLAB_RELEASE_TAG": "release-colab_20250101", "TPU_ACCELERATOR_TYPE": "v2-8"}
    info = detect_xla(env, str(tmp_path), libtpu_only)
    assert (info.platform, info.processes, info.devices) == ("colab", 4, 8)


def test_colab_v5e_1_is_one_chip_with_one_core(tmp_path):
    fake_pci(tmp_path, "0x0063", 1)
    info = detect_xla(COLAB_V5E_1, str(tmp_path), libtpu_only)
    assert info == XlaInfo("TPU", 1, 1, "v5e-1", "colab", "", "v5e")
    assert describe_tpu(info) == "this Colab runtime is a TPU v5e-1 (1 chip, 1 core)"


def test_colab_v5e_1_in_a_container_counts_only_the_chip_it_was_given(tmp_path):
    # /sys lists every chip of the host; /dev/vfio holds the group of the one given.
    fake_pci(tmp_path, "0x0063", 4, given=1)
    info = detect_xla(COLAB_V5E_1, str(tmp_path), libtpu_only)
    assert (info.processes, info.devices, info.missing) == (1, 1, "")


def test_colab_v5e_1_from_vfio_device_files(tmp_path):
    fake_devices(tmp_path, "dev/vfio/{}", 1)
    (tmp_path / "dev/vfio/vfio").touch()  # the VFIO container, not a chip
    info = detect_xla(COLAB_V5E_1, str(tmp_path), libtpu_only)
    assert (info.platform, info.processes, info.devices) == ("colab", 1, 1)


def test_kaggle_v5e_8_is_eight_chips_with_one_core_each(tmp_path):
    fake_pci(tmp_path, "0x0063", 8)
    info = detect_xla(KAGGLE_V5E_8, str(tmp_path), libtpu_only)
    assert info == XlaInfo("TPU", 8, 1, "v5litepod-8", "kaggle", "", "v5e")
    assert describe_tpu(info) == "this Kaggle session is a TPU v5e-8 (8 chips, 1 core each)"


@pytest.mark.parametrize(
    ("environ", "chips", "described"),
    [
        ({**KAGGLE_V5E_8, "TPU_ACCELERATOR_TYPE": "v6e-8"}, 8, "is a TPU v6e-8 (8 chips"),
        ({**COLAB_V5E_1, "TPU_ACCELERATOR_TYPE": "v6e-1"}, 1, "is a TPU v6e-1 (1 chip, 1 core)"),
        ({}, 4, "this TPU VM has TPU v6e chips (4 chips, 1 core each)"),
    ],
)
def test_v6e_hosts(tmp_path, environ, chips, described):
    fake_pci(tmp_path, "0x006f", chips)
    info = detect_xla(environ, str(tmp_path), libtpu_only)
    assert (info.processes, info.devices_per_process, info.chip) == (chips, 1, "v6e")
    assert described in describe_tpu(info)


def test_chips_without_their_device_files_are_found_but_not_given(tmp_path):
    """A container on a TPU host that was not given the TPU (Kaggle's pinned CPU image)."""
    fake_pci(tmp_path, "0x0063", 8, given=0)
    info = detect_xla({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, str(tmp_path), libtpu_only)
    assert info.devices == 8 and not info.reachable


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
    monkeypatch.setattr(registry, "detect_xla", lambda environ: XlaInfo("TPU", 4, 2))
    found = registry.detect_hardware()
    assert found.tpu_cores == 8 and found.accelerator == "xla"
    assert registry.offered_platforms(found)[0] == "xla"
    monkeypatch.setattr(registry, "detect_xla", lambda environ: XlaInfo("CPU", 1, 1))
    found = registry.detect_hardware()
    assert found.accelerator == "cpu"  # XLA's CPU device only when asked for


def tpu_host(environ: dict, root: Path, cpu_cores: int) -> Hardware:
    """The Hardware detect_hardware() reports on a host with these variables and files."""
    info = detect_xla(environ, str(root), libtpu_only)
    return Hardware(tpu_cores=info.devices if info else 0, xla=info, cpu_cores=cpu_cores)


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


def test_colab_v5e_1_trains_in_one_worker(torch_xla_installed, tmp_path):
    """The kernel never opens the TPU: its one chip goes to one worker process."""
    fake_pci(tmp_path, "0x0063", 1)
    colab = tpu_host(COLAB_V5E_1, tmp_path, cpu_cores=44)
    plan = plan_launch(function=train, hardware=colab)
    assert plan.platform.name == "xla"
    assert plan.local_world_size == 1 and not plan.in_process
    # Written for a v2-8: refused before anything starts, saying what the runtime has.
    with pytest.raises(ValueError) as refused:
        plan_launch(function=train, hardware=colab, num_processes=8)
    assert str(refused.value) == (
        "num_processes=8 asks for one TPU core per worker, but this machine has 1 (this "
        "Colab runtime is a TPU v5e-1 (1 chip, 1 core), so a launch trains in one worker "
        "process). Pass num_processes=1 or leave it unset."
    )


def test_kaggle_v5e_8_runs_eight_workers_one_per_chip(torch_xla_installed, tmp_path):
    fake_pci(tmp_path, "0x0063", 8)
    kaggle = tpu_host(KAGGLE_V5E_8, tmp_path, cpu_cores=224)
    plan = plan_launch(function=train, hardware=kaggle, num_processes=8)
    assert plan.local_world_size == 8 and plan.world_size == 8
    assert plan_launch(function=train, hardware=kaggle).local_world_size == 8
    with pytest.raises(ValueError, match=r"one process per chip; this Kaggle session is a TPU"):
        plan_launch(function=train, hardware=kaggle, num_processes=4)


def test_a_tpu_the_session_was_not_given_is_refused_with_the_fix(torch_xla_installed, tmp_path):
    fake_pci(tmp_path, "0x0063", 8, given=0)
    machine = Hardware(tpu_cores=8, xla=detect_xla({"KAGGLE_URL_BASE": "x"}, str(tmp_path)))
    with pytest.raises(RuntimeError) as refused:
        plan_launch(function=train, hardware=machine)
    message = str(refused.value)
    assert "on this machine's PCI bus but not their device files (/dev/vfio/N)" in message
    assert "'Always use latest environment'" in message
    assert message.endswith("To train on CPU workers instead, pass backend='cpu'.")


@pytest.mark.parametrize(
    ("hardware_", "options", "error", "message"),
    [
        (V5E_8, {"num_processes": 4}, ValueError, "Pass num_processes=8 or 1"),
        (V5E_8, {"num_processes": 16}, ValueError, "but this machine has 8"),
        (V5E_8, {"mixed_precision": "fp16"}, ValueError, "use mixed_precision='bf16'"),
        (V5E_8, {"mixed_precision": "fp8"}, ValueError, "fp8 needs a CUDA GPU"),
        (V5E_8, {"num_nodes": 2}, ValueError, "runs on one machine"),
        (V5E_8, {"backend": "xla", "devices": [0]}, ValueError, "devices= chooses accelerator"),
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


@pytest.mark.parametrize(
    ("variable", "message"),
    [
        ("COLAB_RELEASE_TAG", "this Colab runtime has no TPU: choose Runtime > Change runtime"),
        ("KAGGLE_KERNEL_RUN_TYPE", "this Kaggle session has no TPU: choose the TPU VM v5e-8"),
    ],
)
def test_colab_or_kaggle_without_a_tpu_says_how_to_get_one(monkeypatch, variable, message):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(RuntimeError, match=message):
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


@pytest.mark.parametrize(
    ("torch_version", "command"),
    [
        ("2.8.0+cpu", 'pip install "torch_xla[tpu]==2.8.*"'),
        ("2.9.1+cu128", 'pip install "torch_xla[tpu]==2.9.*"'),
        # No torch_xla for later torch: its wheels do not say so, and would not load.
        ("2.13.0+cpu", 'pip install "torch==2.9.*" "torch_xla[tpu]==2.9.*"'),
        ("2.10.0", 'pip install "torch==2.9.*" "torch_xla[tpu]==2.9.*"'),
    ],
)
def test_the_install_command_matches_the_installed_torch(torch_version, command):
    assert install_command(torch_version) == command


def test_missing_torch_xla_says_how_to_install():
    assert "torch_xla" not in sys.modules
    with pytest.raises(ImportError) as refused:
        plan_launch(function=train, hardware=V5E_8)
    message = str(refused.value)
    assert message.startswith("This TPU VM is a TPU v5e-8 (8 chips, 1 core each), but the XLA")
    assert f"needs torch_xla, which is not installed: {install_command()}" in message
    assert "then restart the kernel" in message
    assert "pip install 'notebook-accel[xla]'" in message  # the extra is named


def test_kaggle_tpu_without_torch_xla_is_refused_with_the_fix(tmp_path, monkeypatch):
    """Not a CPU run that looks like a TPU one: the launch names the cause and the fix."""
    fake_pci(tmp_path, "0x0063", 8)
    kaggle = tpu_host(KAGGLE_V5E_8, tmp_path, cpu_cores=224)
    monkeypatch.setattr(preflight, "detect", lambda: kaggle)
    for env in KAGGLE_V5E_8.items():
        monkeypatch.setenv(*env)
    with pytest.raises(ImportError) as refused:
        plan_launch(function=train, num_processes=8)
    message = str(refused.value)
    assert message.startswith("This Kaggle session is a TPU v5e-8 (8 chips, 1 core each), but")
    assert "choose 'Always use latest environment' instead of a pinned one" in message
    assert install_command() in message


def test_an_installed_torch_tpu_is_named(monkeypatch):
    torch_tpu = types.ModuleType("torch_tpu")
    torch_tpu.__spec__ = importlib.machinery.ModuleSpec("torch_tpu", None)
    monkeypatch.setitem(sys.modules, "torch_tpu", torch_tpu)
    with pytest.raises(ImportError, match="torch_tpu, PyTorch's own TPU backend, is installed"):
        plan_launch(function=train, hardware=V5E_8)


def test_accelerator_without_torch_xla_says_how_to_install(monkeypatch):
    from notebook_accel import Accelerator

    monkeypatch.setenv("NOTEBOOK_ACCEL_BACKEND", "xla")
    with pytest.raises(ImportError, match=r"^The XLA backend \(TPUs\) needs torch_xla") as refused:
        Accelerator()
    assert install_command() in str(refused.value)


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


# -- an Accelerator made outside a launch ------------------------------------------

COLAB_TPU = XlaInfo("TPU", 1, 1, "v5e-1", "colab", chip="v5e")


@pytest.fixture
def kernel_on(monkeypatch):
    """Put this process on a machine whose detection reports `info`, outside any launch."""
    from notebook_accel import AcceleratorState

    def on(info: XlaInfo | None) -> None:
        monkeypatch.setattr(registry, "detect_xla", lambda environ: info)
        registry.tpu_of_this_machine.cache_clear()
        AcceleratorState._reset_state(reset_partial_state=True)

    for name in ("NOTEBOOK_ACCEL_BACKEND", "PJRT_LOCAL_PROCESS_COUNT", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(registry.torch.cuda, "is_available", lambda: False)
    yield on
    registry.tpu_of_this_machine.cache_clear()
    AcceleratorState._reset_state(reset_partial_state=True)


def test_an_accelerator_outside_a_launch_trains_on_the_tpu(torch_xla_installed, kernel_on):
    """As Accelerate's Accelerator() in a TPU kernel: one process on the first core."""
    import torch

    from notebook_accel import Accelerator, DistributedType, PartialState

    kernel_on(COLAB_TPU)
    accelerator = Accelerator()
    assert accelerator.state.platform.name == "xla"
    assert accelerator.device == torch.device("xla", 0)
    assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
    assert accelerator.distributed_type == DistributedType.NO
    assert PartialState().device == torch.device("xla", 0)
    # Only named: the runtime starts when a model or tensor first goes there.
    assert not torch_xla_installed._XLAC._xla_runtime_is_initialized()


def test_cpu_true_trains_on_the_cpu_beside_a_tpu(torch_xla_installed, kernel_on):
    import torch

    from notebook_accel import Accelerator

    kernel_on(COLAB_TPU)
    assert Accelerator(cpu=True).device == torch.device("cpu")


def test_xla_s_cpu_device_is_not_chosen_unasked(kernel_on):
    from notebook_accel import Accelerator

    kernel_on(XlaInfo("CPU", 1, 1))  # PJRT_DEVICE=CPU: for tests, opt-in like in launches
    assert Accelerator().state.platform.name == "cpu"


def test_a_tpu_without_torch_xla_is_refused_in_one_line(kernel_on):
    """Never a CPU run that looks like a TPU one: the cause, the fix, and cpu=True."""
    from notebook_accel import Accelerator

    kernel_on(COLAB_TPU)
    with pytest.raises(ImportError) as refused:
        Accelerator()
    message = str(refused.value)
    assert message.startswith(
        "This Colab runtime is a TPU v5e-1 (1 chip, 1 core), but Accelerator() cannot train "
        "on it in this process: the XLA backend (TPUs) needs torch_xla, which is not installed: "
    )
    assert install_command() in message
    assert message.endswith("To train on the CPU instead, pass cpu=True.")
    assert "\n" not in message
    assert Accelerator(cpu=True).state.platform.name == "cpu"


def test_a_tpu_this_process_was_not_given_is_refused_in_one_line(torch_xla_installed, kernel_on):
    from notebook_accel import PartialState

    kernel_on(XlaInfo("TPU", 8, 1, "v5litepod-8", "kaggle", chip="v5e", reachable=False))
    with pytest.raises(RuntimeError) as refused:
        PartialState()
    message = str(refused.value)
    assert "its device files (/dev/vfio/N) are not here" in message
    assert "'Always use latest environment'" in message
    assert message.endswith("To train on the CPU instead, pass cpu=True.")
    assert "\n" not in message


def test_a_tpu_without_libtpu_is_refused(torch_xla_installed, kernel_on):
    from notebook_accel import Accelerator

    kernel_on(XlaInfo("TPU", 4, 1, missing="libtpu (pip install x)"))
    with pytest.raises(RuntimeError, match=r"libtpu \(pip install x\) is not installed\. To"):
        Accelerator()
