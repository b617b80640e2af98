"""Environments built once outside the checkout and shared by every checkout on the machine.

A torch other than the project's own (torch_xla's, the oldest and newest of the tested
range) is several GB, so each such environment lives in the user's cache, keyed by what
it holds, and holds nothing that points at a checkout: the project is not installed in
it. Code runs there with its own checkout first on PYTHONPATH (`environment`), so no
checkout can change what another one runs. tests/xla/make_env.py and
tests/torch_range/make_env.py build theirs with these helpers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    """Where the environments live: $XDG_CACHE_HOME/notebook_accel, else ~/.cache/..."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "notebook_accel"


def python_tag() -> str:
    """ "py311" for Python 3.11: an environment is built for one Python."""
    return f"py{sys.version_info.major}{sys.version_info.minor}"


def project() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def small_deps() -> list[str]:
    """The project's dependencies other than torch, read from pyproject.toml."""
    return [dep for dep in project()["dependencies"] if not dep.startswith("torch")]


def environment(checkout: Path = REPO, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's variables) with `checkout` first on PYTHONPATH:
    how a test runs its own checkout's code in a shared environment."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    return env


def pip(python: Path, *args: str) -> None:
    """pip install in the environment of `python`, run from / (no checkout near)."""
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *args], check=True, cwd="/")


def pip_finds(package: str, version: str) -> bool:
    """Whether pip, with its own configuration (index, extra indexes, find-links,
    proxy), finds `package` at `version`: then a failed build is a real failure, not a
    machine without the package."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", package],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    listed = re.search(rf"(?<![\w.]){re.escape(version)}(?![\w.])", done.stdout)
    return done.returncode == 0 and listed is not None


def run(python: Path, script: str, env: Mapping[str, str] | None = None) -> str:
    """What `script` prints in the environment, run from / so no checkout is near."""
    done = subprocess.run(
        [str(python), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env=dict(os.environ if env is None else env),
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


def imported_from(python: Path, env: Mapping[str, str] | None = None) -> str:
    """The file `import notebook_accel` loads in the environment with `env` ("" if none)."""
    return run(python, _WHERE, env)


def checkout_pointer(python: Path) -> str:
    """What in the environment itself points at a checkout, "" when nothing does:
    an installed notebook-accel (editable or not, even one whose checkout is gone),
    or a notebook_accel importable without PYTHONPATH."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    return run(python, _POINTER, env)


def drop_checkout_pointer(python: Path) -> None:
    """Uninstall notebook-accel from the environment if something installed it."""
    if checkout_pointer(python):
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "--quiet", "-y", "notebook-accel"],
            check=True,
            cwd="/",
        )


def check_imports_checkout(python: Path, checkout: Path = REPO) -> None:
    """SystemExit unless the environment imports notebook_accel from `checkout` when it
    is on PYTHONPATH."""
    found = imported_from(python, environment(checkout))
    if not found or not Path(found).resolve().is_relative_to(checkout):
        raise SystemExit(
            f"the environment of {python} imports notebook_accel from {found or 'nowhere'}, "
            f"not from {checkout}, even with PYTHONPATH={checkout}"
        )


def size(path: Path) -> int:
    """Bytes in the files under `path` (links not followed)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
