"""Build, once, the virtual environment the XLA CPU-device tests run in.

torch_xla pins its torch (2.9.0 for torch_xla 2.9.0), and the default torch 2.9.0 wheel
brings CUDA libraries (several GB), so this environment lives outside the
checkout, keyed by the versions, and is reused while it still imports:

    python tests/xla/make_env.py           # build or reuse; prints its python
    NOTEBOOK_ACCEL_XLA_VENV=/some/dir ...  # put it elsewhere

The project goes in editable with --no-deps plus its small dependencies, so
pip never replaces the pinned torch. If the cached environment points at
another checkout, only that editable install is redone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TORCH_VERSION = "2.9.0"
TORCH_XLA_VERSION = "2.9.0"
REPO = Path(__file__).resolve().parents[2]


def small_deps() -> list[str]:
    """The project's dependencies other than torch, read from pyproject.toml."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [dep for dep in project["dependencies"] if not dep.startswith("torch")]


def venv_dir() -> Path:
    """Where the environment lives: keyed by torch, torch_xla and Python versions."""
    override = os.environ.get("NOTEBOOK_ACCEL_XLA_VENV")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache / "notebook_accel" / f"xla-venv-torch{TORCH_VERSION}-xla{TORCH_XLA_VERSION}-{py}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


# Only torch and torch_xla decide whether the environment is usable: the
# project itself is reinstalled every time (its checkout may have moved).
_PROBE = """
import importlib.metadata as md, sys
import torch, torch_xla
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert md.version("torch_xla") == sys.argv[2], md.version("torch_xla")
print(torch_xla.__file__)
"""


def _probe() -> str | None:
    """Where torch_xla imports from in the environment, or None if it is unusable."""
    python = venv_python()
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", _PROBE, TORCH_VERSION, TORCH_XLA_VERSION],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",  # so the checkout on the current directory does not mask the install
    )
    return done.stdout.strip() if done.returncode == 0 else None


def _pip(*args: str) -> None:
    subprocess.run([str(venv_python()), "-m", "pip", "install", "--quiet", *args], check=True)


def _install_project() -> None:
    # The dependencies again each time: pyproject.toml may have gained one
    # since the environment was cached (a no-op when they are there).
    _pip(*small_deps(), f"torch=={TORCH_VERSION}")
    _pip("--no-deps", "-e", str(REPO))


def ensure() -> Path:
    """Build or reuse the environment; return its python."""
    found = _probe()
    if found is not None:
        _install_project()  # point it at this checkout, with today's dependencies
        return venv_python()

    target = venv_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
    _pip("--upgrade", "pip")
    # torch first and exactly, then torch_xla, which pins the same torch.
    _pip(f"torch=={TORCH_VERSION}")
    _pip(f"torch_xla=={TORCH_XLA_VERSION}", f"torch=={TORCH_VERSION}")
    _install_project()
    if _probe() is None:
        raise SystemExit(f"the environment at {target} was built but does not import torch_xla")
    done = subprocess.run([str(venv_python()), "-c", "import notebook_accel"], cwd="/")
    if done.returncode != 0:
        raise SystemExit(f"the environment at {target} does not import notebook_accel")
    return venv_python()


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main() -> None:
    start = time.monotonic()
    python = ensure()
    seconds = time.monotonic() - start
    size_gb = _size(venv_dir()) / 1e9
    print(f"XLA environment ready in {seconds:.0f} s ({size_gb:.1f} GB): {python}")


if __name__ == "__main__":
    main()
