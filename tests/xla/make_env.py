"""Build, once, the virtual environment the XLA CPU-device tests run in.

torch_xla pins its torch (2.9.0 for torch_xla 2.9.0), and the default torch 2.9.0 wheel
brings CUDA libraries (several GB), so this environment lives outside the
checkout, keyed by the versions, and is reused while it still imports:

    python tests/xla/make_env.py           # build or reuse; prints its python
    NOTEBOOK_ACCEL_XLA_VENV=/some/dir ...  # put it elsewhere

Every checkout on the machine shares it, so it holds torch, torch_xla and the
project's small dependencies (torch pinned, so pip never replaces it), and
nothing that points at a checkout: the project is not installed in it. Code
runs there with its own checkout first on PYTHONPATH (`environment()`), so no
checkout can change what another one runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
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


def environment(checkout: Path = REPO, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's variables) with `checkout` first on PYTHONPATH:
    how a test runs its own checkout's code in the shared environment."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    return env


# Only torch and torch_xla decide whether the environment is usable: the
# project is never installed in it (see the module's docstring).
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


def _install_dependencies() -> None:
    # Again each time: pyproject.toml may have gained one since the environment
    # was cached (a no-op when they are there).
    _pip(*small_deps(), f"torch=={TORCH_VERSION}")


def _run(script: str, env: Mapping[str, str]) -> str:
    """What `script` prints in the environment, run from / so no checkout is near."""
    done = subprocess.run(
        [str(venv_python()), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env=dict(env),
        check=True,
    )
    return done.stdout.strip()


_WHERE = """
import importlib.util
spec = importlib.util.find_spec("notebook_accel")
print(spec.origin if spec else "")
"""

_POINTER = """
import importlib.metadata as md, importlib.util
try:
    print("notebook-accel", md.distribution("notebook-accel").version, "is installed")
except md.PackageNotFoundError:
    spec = importlib.util.find_spec("notebook_accel")
    print(f"notebook_accel imports from {spec.origin}" if spec else "")
"""


def imported_from(env: Mapping[str, str] | None = None) -> str:
    """The file `import notebook_accel` loads in the environment with `env` ("" if none)."""
    return _run(_WHERE, os.environ if env is None else env)


def checkout_pointer() -> str:
    """What in the environment itself points at a checkout, "" when nothing does:
    an installed notebook-accel (editable or not, even one whose checkout is gone),
    or a notebook_accel importable without PYTHONPATH."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    return _run(_POINTER, env)


def _drop_checkout_pointer() -> None:
    # Earlier versions of this script installed the last checkout that ran it,
    # editable: the one pointer two checkouts would fight over.
    if checkout_pointer():
        subprocess.run(
            [str(venv_python()), "-m", "pip", "uninstall", "--quiet", "-y", "notebook-accel"],
            check=True,
            cwd="/",
        )


def ensure() -> Path:
    """Build or reuse the environment; return its python."""
    target = venv_dir()
    if _probe() is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
        _pip("--upgrade", "pip")
        # torch first and exactly, then torch_xla, which pins the same torch.
        _pip(f"torch=={TORCH_VERSION}")
        _pip(f"torch_xla=={TORCH_XLA_VERSION}", f"torch=={TORCH_VERSION}")
        if _probe() is None:
            raise SystemExit(f"the environment at {target} was built but does not import torch_xla")
    _install_dependencies()
    _drop_checkout_pointer()
    found = imported_from(environment())
    if not found or not Path(found).resolve().is_relative_to(REPO):
        raise SystemExit(
            f"the environment at {target} imports notebook_accel from {found or 'nowhere'}, "
            f"not from {REPO}, even with PYTHONPATH={REPO}"
        )
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
