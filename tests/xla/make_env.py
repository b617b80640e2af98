"""Build, once, the virtual environment the XLA CPU-device tests run in.

torch_xla pins its torch (2.9.0 for torch_xla 2.9.0), and the default torch 2.9.0 wheel
brings CUDA libraries (several GB), so this environment lives outside the
checkout, keyed by the versions, and is reused while it still imports:

    python tests/xla/make_env.py           # build or reuse; prints its python
    NOTEBOOK_ACCEL_XLA_VENV=/some/dir ...  # put it elsewhere

Every checkout on the machine shares it, so it holds torch, torch_xla and the
project's small dependencies (torch pinned, so pip never replaces it), and
nothing that points at a checkout (tests/venv_cache.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import venv_cache  # noqa: E402

TORCH_VERSION = "2.9.0"
TORCH_XLA_VERSION = "2.9.0"
REPO = venv_cache.REPO


def venv_dir() -> Path:
    """Where the environment lives: keyed by torch, torch_xla and Python versions."""
    override = os.environ.get("NOTEBOOK_ACCEL_XLA_VENV")
    if override:
        return Path(override)
    name = f"xla-venv-torch{TORCH_VERSION}-xla{TORCH_XLA_VERSION}-{venv_cache.python_tag()}"
    return venv_cache.cache_dir() / name


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def environment(checkout: Path = REPO, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` with `checkout` first on PYTHONPATH (venv_cache.environment)."""
    return venv_cache.environment(checkout, base)


def imported_from(env: Mapping[str, str] | None = None) -> str:
    """The file `import notebook_accel` loads in the environment with `env` ("" if none)."""
    return venv_cache.imported_from(venv_python(), env)


def checkout_pointer() -> str:
    """What in the environment itself points at a checkout ("" when nothing does)."""
    return venv_cache.checkout_pointer(venv_python())


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


def ensure() -> Path:
    """Build or reuse the environment; return its python."""
    target, python = venv_dir(), venv_python()
    if _probe() is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
        venv_cache.pip(python, "--upgrade", "pip")
        # torch first and exactly, then torch_xla, which pins the same torch.
        venv_cache.pip(python, f"torch=={TORCH_VERSION}")
        venv_cache.pip(python, f"torch_xla=={TORCH_XLA_VERSION}", f"torch=={TORCH_VERSION}")
        if _probe() is None:
            raise SystemExit(f"the environment at {target} was built but does not import torch_xla")
    # Again each time: pyproject.toml may have gained a dependency since the environment
    # was cached (a no-op when they are there).
    venv_cache.pip(python, *venv_cache.small_deps(), f"torch=={TORCH_VERSION}")
    # Earlier versions of this script installed the last checkout that ran it, editable:
    # the one pointer two checkouts would fight over.
    venv_cache.drop_checkout_pointer(python)
    venv_cache.check_imports_checkout(python)
    return python


def main() -> None:
    start = time.monotonic()
    python = ensure()
    seconds = time.monotonic() - start
    size_gb = venv_cache.size(venv_dir()) / 1e9
    print(f"XLA environment ready in {seconds:.0f} s ({size_gb:.1f} GB): {python}")


if __name__ == "__main__":
    main()
