"""Build, once, an environment for each end of the tested torch range.

Each holds one torch (`notebook_accel.internals.tested_range.TESTED_TORCH`: the oldest and the
newest the project is tested on) and what `pip install notebook_accel` brings with it,
nothing more: no numpy unless a dependency declares it, no extras, no dev tools. That
is the environment a new user has, so a dependency the package uses without declaring
it fails there. The test tools (pytest, pytest-timeout, nbclient) sit beside it in a
folder of their own (`pip install --target`), put on PYTHONPATH only for the
compatibility subset, so the bare environment stays bare.

Like the XLA one, each lives outside the checkout, keyed by torch and Python, and holds
nothing that points at a checkout (tests/venv_cache.py):

    python tests/torch_range/range_env.py            # build or reuse both; print them
    python tests/torch_range/range_env.py 2.14.1     # only that one
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import venv_cache  # noqa: E402

from notebook_accel.internals.tested_range import TESTED_TORCH  # noqa: E402

# What the compatibility subset needs besides the package, by name from the dev extra:
# the test tools, and torchdata (exact resume with stateful loaders, an extra's package).
TEST_TOOLS = ("pytest", "pytest-timeout", "nbclient", "nbformat", "torchdata")
# Installed without their requirements: torchdata requires torch, which the environment
# has (pip would put another torch in the tools' folder).
WITHOUT_REQUIREMENTS = ("torchdata",)
# Written into the tools folder: rebuilt when the tools' requirements change.
TOOLS_MARKER = ".notebook_accel_tools"


def versions() -> list[str]:
    """The torch releases of the range's two ends, oldest first."""
    return list(TESTED_TORCH)


def venv_dir(torch_version: str) -> Path:
    return venv_cache.cache_dir() / f"torch{torch_version}-{venv_cache.python_tag()}"


def venv_python(torch_version: str) -> Path:
    return venv_dir(torch_version) / "bin" / "python"


def tools_dir(torch_version: str) -> Path:
    """The test tools' folder, beside the environment (never inside its site-packages)."""
    return venv_dir(torch_version).with_name(venv_dir(torch_version).name + "-test-tools")


def tool_requirements() -> list[str]:
    """The TEST_TOOLS as the dev extra pins them."""
    dev = venv_cache.project()["optional-dependencies"]["dev"]
    return [req for req in dev if _name(req) in TEST_TOOLS]


def _name(requirement: str) -> str:
    return requirement.split(">")[0].split("=")[0].split("<")[0].strip()


_PROBE = """
import sys, torch
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
print(torch.__file__)
"""


def _has_torch(torch_version: str) -> bool:
    python = venv_python(torch_version)
    if not python.exists():
        return False
    done = subprocess.run(
        [str(python), "-c", _PROBE, torch_version],
        capture_output=True,
        timeout=300,
        cwd="/",
    )
    return done.returncode == 0


def _ensure_tools(torch_version: str) -> None:
    folder = tools_dir(torch_version)
    recipe = "\n".join([str(venv_python(torch_version)), *tool_requirements()])
    marker = folder / TOOLS_MARKER
    if marker.exists() and marker.read_text() == recipe:
        return
    shutil.rmtree(folder, ignore_errors=True)
    python = venv_python(torch_version)
    tools = tool_requirements()
    alone = [req for req in tools if _name(req) in WITHOUT_REQUIREMENTS]
    venv_cache.pip(python, "--target", str(folder), *[req for req in tools if req not in alone])
    venv_cache.pip(python, "--target", str(folder), "--no-deps", *alone)
    marker.write_text(recipe)


def ensure(torch_version: str) -> Path:
    """Build or reuse the environment for `torch_version`; return its python."""
    target, python = venv_dir(torch_version), venv_python(torch_version)
    if not _has_torch(torch_version):
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
        venv_cache.pip(python, "--upgrade", "pip")
        venv_cache.pip(python, f"torch=={torch_version}")
        if not _has_torch(torch_version):
            raise SystemExit(
                f"the environment at {target} was built but has no torch {torch_version}"
            )
    # Again each time: pyproject.toml may have gained a dependency since the environment
    # was cached (a no-op when they are there). torch pinned, so pip never replaces it.
    venv_cache.pip(python, *venv_cache.small_deps(), f"torch=={torch_version}")
    venv_cache.drop_checkout_pointer(python)
    venv_cache.check_imports_checkout(python)
    _ensure_tools(torch_version)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch", nargs="*", default=versions(), help="torch releases to build")
    for torch_version in parser.parse_args().torch:
        start = time.monotonic()
        python = ensure(torch_version)
        seconds = time.monotonic() - start
        size_gb = venv_cache.size(venv_dir(torch_version)) / 1e9
        size = f"{seconds:.0f} s ({size_gb:.1f} GB)"
        print(f"torch {torch_version} environment ready in {size}: {python}")


if __name__ == "__main__":
    main()
