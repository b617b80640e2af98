"""The notebook-accel command: env, config, launch (through torchrun), test."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from notebook_accel.cli import main
from tests_support import run_together, suite_port


def cli(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "notebook_accel.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_env_reports_versions_hardware_and_settings(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "Python",
        "torch",
        "ipykernel",
        "ipywidgets",
        "notebook-accel",
        "accelerator     cpu",
        "CPU cores",
        "NCCL_DEBUG=INFO",
    ):
        assert expected in out


def test_env_says_when_this_torch_is_outside_the_tested_range(capsys, monkeypatch):
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from notebook_accel.internals.tested_range import tested_range

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"tested on       {tested_range()}, Python" in out
    assert "UNTESTED" not in out  # the suite's own torch is in the range
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu126")
    monkeypatch.delattr(DeviceMesh, "_flatten")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"UNTESTED        torch 2.8.0+cu126 is outside the tested {tested_range()}" in out
    assert "UNTESTED        this torch lacks DeviceMesh._flatten" in out


def test_config_writes_checks_and_names_bad_keys_with_their_line(tmp_path, capsys):
    path = tmp_path / "launch.yaml"
    assert (
        main(["config", "--file", str(path), "--num-processes", "3", "--mixed-precision", "bf16"])
        == 0
    )
    assert main(["config", "--file", str(path), "--gradient-accumulation-steps", "2"]) == 0
    assert main(["config", "--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "num_processes: 3" in out and "mixed_precision: bf16" in out
    assert "gradient_accumulation_steps: 2" in out and "valid" in out
    path.write_text("num_processes: 2\nmixed_precison: bf16\n")
    assert main(["config", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2: unknown key 'mixed_precison'; did you mean 'mixed_precision'" in err
    assert main(["config", "--file", str(path), "--num-processes", "0"]) == 2


SCRIPT = textwrap.dedent("""
    import sys, torch
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index)]))
    accelerator.print("world", accelerator.num_processes, "precision",
                      accelerator.mixed_precision, "sum", total.item(), "args", sys.argv[1:])
""")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--warm", "maybe", "argument --warm: expected true or false, got 'maybe'"),
        ("--devices", "a,b", "argument --devices: expected GPU indices separated by commas"),
        ("--num-processes", "0", "num_processes=0 must be at least 1."),
    ],
)
def test_config_flags_say_what_a_bad_value_should_be(tmp_path, capsys, flag, value, message):
    try:  # argparse exits with 2 for what it parses; main returns 2 for the checks
        code = main(["config", "--file", str(tmp_path / "launch.yaml"), flag, value])
    except SystemExit as refused:
        code = refused.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "launch.yaml").exists()


def test_launch_runs_a_script_through_torchrun_with_the_config(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "launch.yaml"
    config.write_text("num_processes: 2\nmixed_precision: bf16\n")
    done = cli("launch", "--config", str(config), str(script), "--epochs", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "world 2 precision bf16 sum 1.0 args ['--epochs', '3']" in done.stdout


def test_launch_dry_run_shows_the_torchrun_command(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = tmp_path / "launch.yaml"
    config.write_text("num_processes: 2\nnum_nodes: 2\nnode_rank: 1\nmaster_addr: 10.0.0.1\n")
    assert main(["launch", "--config", str(config), "--dry-run", str(script), "-x"]) == 0
    out = capsys.readouterr().out
    for part in (
        "-m torch.distributed.run",
        "--nproc-per-node=2",
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=10.0.0.1",
        "--master-port=29500",
        "-x",
        "NOTEBOOK_ACCEL_MIXED_PRECISION=no",
    ):
        assert part in out


def test_launch_refuses_a_missing_script_and_impossible_precision(tmp_path, capsys):
    assert main(["launch", str(tmp_path / "nope.py")]) == 2
    assert "no script at" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert main(["launch", "--mixed-precision", "fp8", str(script)]) == 2
    assert "fp8 needs a CUDA GPU" in capsys.readouterr().err


def test_self_check_passes_on_two_cpu_workers():
    done = cli("test", "--processes", "2", "--cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    for check in ("reduce", "gather", "gather_for_metrics", "ddp_step"):
        assert f"ok   {check}" in done.stdout
    assert "self-check passed" in done.stdout


def test_self_check_forks_even_a_single_worker():
    done = cli("test", "--processes", "1", "--cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 worker(s) on cpu" in done.stdout and "self-check passed" in done.stdout


@pytest.mark.timeout(180)
def test_launch_on_two_machines_forms_one_group(tmp_path):
    """Two `notebook-accel launch` calls, as node 0 and node 1, on this machine."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = suite_port()
    commands = []
    for rank in (0, 1):
        config = tmp_path / f"node{rank}.yaml"
        config.write_text(
            f"num_processes: 2\nnum_nodes: 2\nnode_rank: {rank}\n"
            f"master_addr: 127.0.0.1\nuse_port: {port}\n"
        )
        commands.append(
            [
                sys.executable,
                "-m",
                "notebook_accel.cli",
                "launch",
                "--config",
                str(config),
                str(script),
            ]
        )
    outputs = run_together(commands, timeout=150)
    if any(code != 0 for code, _, _ in outputs):  # both nodes' errors in full
        pytest.fail(
            "\n\n".join(f"node {n} exited {c}:\n{e[-3000:]}" for n, (c, _, e) in enumerate(outputs))
        )
    assert "world 4 precision no sum 6.0" in outputs[0][1]
