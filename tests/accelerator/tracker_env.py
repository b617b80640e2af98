"""Build, once, the environment the real-tracker tests run their runs in.

The experiment trackers (the `trackers` extra) are not in `dev`: Accelerate's example
scripts log with `log_with="all"`, which starts every tracker installed, so the
example tests would start all of them. They live in an environment of their own
beside the checkout's .venv instead, `.venv-trackers`, which sees everything the
interpreter running this script has (a .pth file adds its site-packages after its
own, editable installs included) and adds only the trackers and what they need:

    .venv/bin/python tests/accelerator/tracker_env.py     # build or reuse; prints its python
    NOTEBOOK_ACCEL_TRACKERS_VENV=/some/dir ...            # put it elsewhere

`make test` builds it; tests/accelerator/test_real_trackers.py runs its runs there.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the environment was built from: rebuilt when the extra or the parent changes.
MARKER = ".notebook_accel_trackers"
# The import name of each package of the extra (Accelerate's tracker names).
MODULES = ("mlflow", "wandb", "dvclive", "trackio", "swanlab", "comet_ml", "clearml", "aim")


def venv_dir() -> Path:
    override = os.environ.get("NOTEBOOK_ACCEL_TRACKERS_VENV")
    return Path(override) if override else REPO / ".venv-trackers"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def requirements() -> list[str]:
    """The `trackers` extra, read from pyproject.toml."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"]["trackers"])


def _recipe() -> str:
    return "\n".join([sys.prefix, *requirements()])


def _usable() -> bool:
    """Whether the environment exists, was built from today's recipe, and imports."""
    marker = venv_dir() / MARKER
    if not venv_python().exists() or not marker.exists() or marker.read_text() != _recipe():
        return False
    probe = f"import notebook_accel, torch; import {', '.join(MODULES)}"
    done = subprocess.run(
        [str(venv_python()), "-c", probe], capture_output=True, timeout=300, cwd="/"
    )
    return done.returncode == 0


def _own_site_packages() -> Path:
    done = subprocess.run(
        [str(venv_python()), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.strip())


def ensure() -> Path:
    """Build or reuse the environment; return its python."""
    if _usable():
        return venv_python()
    target = venv_dir()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
    # addsitedir (not a plain path line) so the parent's own .pth files, its editable
    # install of this project among them, are read too.
    parents = "; ".join(f"site.addsitedir({path!r})" for path in site.getsitepackages())
    (_own_site_packages() / "notebook_accel_parent.pth").write_text(f"import site; {parents}\n")
    subprocess.run(
        [str(venv_python()), "-m", "pip", "install", "--quiet", *requirements()], check=True
    )
    (target / MARKER).write_text(_recipe())
    if not _usable():
        raise SystemExit(f"the environment at {target} was built but does not import the trackers")
    return venv_python()


def main() -> None:
    start = time.monotonic()
    python = ensure()
    print(f"tracker environment ready in {time.monotonic() - start:.0f} s: {python}")


if __name__ == "__main__":
    main()
