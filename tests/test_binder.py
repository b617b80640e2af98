"""The Binder environment: binder/requirements.txt, installed into a fresh virtual
environment as repo2docker would, runs the quickstart notebook on CPU.

The CPU torch comes from this machine's usual pip sources (as in CI), not from the
PyTorch index named in the file, which is there for Binder's build.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "binder" / "requirements.txt"
TORCH = "torch==2.13.0"

# Runs inside the new environment: execute the notebook in a kernel of that
# environment's python, then one more cell that says where the kernel's packages came from.
RUNNER = textwrap.dedent(
    """
    import sys

    import nbformat
    from nbclient import NotebookClient

    source, workdir, executed = sys.argv[1:]
    notebook = nbformat.read(source, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import sys, torch, notebook_accel\\n"
        "print('PREFIX', sys.prefix)\\n"
        "print('PACKAGE', notebook_accel.__file__)\\n"
        "print('TORCH', torch.__version__)"
    ))
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": workdir}}
    )
    try:
        client.execute()
    finally:
        nbformat.write(notebook, executed)
    """
)


def copy_as_cloned(destination: Path) -> None:
    """Copy the files a clone of this checkout has: those git tracks, and new ones it does
    not ignore. Not build outputs beside them (.venv-trackers alone is over 500 MB)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # not one deleted from the working tree
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def run(command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """Run a step in its own process group, so a timeout stops the step and all it started."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **options,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} took over {timeout} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, None)


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout[-3000:]}"
    return result


def requirement_lines() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def test_requirements_name_cpu_torch_the_package_and_jupyterlab():
    lines = requirement_lines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert TORCH in lines
    assert "-e ." in lines
    names = {line.split(">")[0].split("=")[0].split("<")[0] for line in lines}
    assert {"jupyterlab", "ipywidgets", "matplotlib"} <= names


def local_requirements() -> list[str]:
    """The file's requirements less the torch line and the index options (torch is local)."""
    return [
        line
        for line in requirement_lines()
        if not line.startswith(("torch", "--index-url", "--extra-index-url", "-i "))
    ]


@pytest.mark.timeout(600)
def test_quickstart_runs_in_a_fresh_binder_environment(tmp_path):
    # A clean environment: nothing from the test's own interpreter or user site.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PYTHONNOUSERSITE"] = "1"

    probe = run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp_path / "probe", "six"],
        timeout=120,
        env=env,
    )
    if probe.returncode != 0:
        pytest.skip(f"pip cannot reach a package index:\n{probe.stdout[-1500:]}")

    repo = tmp_path / "repo"  # what Binder clones
    copy_as_cloned(repo)
    venv = tmp_path / "venv"
    checked(run([sys.executable, "-m", "venv", venv], timeout=120, env=env))
    python = str(venv / "bin" / "python")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # Kernel specs of this environment first, so "python3" is its own python.
    env["JUPYTER_PATH"] = str(venv / "share" / "jupyter")

    requirements = tmp_path / "requirements.txt"
    requirements.write_text("\n".join(local_requirements()) + "\n")
    # One install, as repo2docker makes it, from the repository's root, so "-e ." is this
    # repository; nbclient only to execute the notebook here. Not compiled at install:
    # the kernel compiles what it imports, a fraction of torch's thousands of modules
    # (measured: a seventh less CPU time for the whole test).
    command = [python, "-m", "pip", "install", "-q", "--no-compile", TORCH]
    checked(run([*command, "-r", requirements, "nbclient"], timeout=480, env=env, cwd=repo))

    runner = tmp_path / "run_notebook.py"
    runner.write_text(RUNNER)
    executed = tmp_path / "executed.ipynb"
    notebook = repo / "notebooks" / "01_quickstart.ipynb"
    checked(run([python, runner, notebook, tmp_path, executed], timeout=240, env=env))

    cells = nbformat.read(executed, as_version=4).cells
    outputs = [o for cell in cells for o in cell.get("outputs", [])]
    assert [o for o in outputs if o.output_type == "error"] == []
    text = "".join(o.get("text", "") for o in outputs)
    assert "trained on 2 worker(s) (cpu): accuracy" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "no loss curve was drawn"
    assert f"PREFIX {venv}" in text
    assert f"PACKAGE {repo / 'notebook_accel'}" in text
    assert "TORCH 2.13.0" in text
