"""Helpers for the documentation site's tests: strict builds of the site, in a subprocess
with this interpreter's mkdocs (as `make docs` does), and its hook modules."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOKS = REPO_ROOT / "docs" / "hooks"

# Bounds every build (seconds): about 15 s here, more on a busy machine.
BUILD_TIMEOUT = 300


@dataclass
class Build:
    returncode: int
    output: str  # stdout and stderr together: mkdocs logs to stderr
    site_dir: Path

    def page(self, path: str) -> str:
        """The HTML of the page at `path` (a URL path such as "guides/checkpoints/")."""
        return (self.site_dir / path / "index.html").read_text(encoding="utf-8")


def build_site(config_dir: Path, site_dir: Path) -> Build:
    """`mkdocs build --strict` of the mkdocs.yml in `config_dir`, into `site_dir`."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=config_dir,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    return Build(done.returncode, done.stdout, site_dir)


def make_docs(site_dir: Path) -> Build | None:
    """`make docs` (the README's command, a strict build) into `site_dir`, with this
    interpreter's environment counted as built; None where make is not installed."""
    make = shutil.which("make")
    if make is None:
        return None
    done = subprocess.run(
        [
            make,
            "-o",
            ".venv/.installed",
            "docs",
            f"SITE={site_dir}",
            f"BIN={Path(sys.executable).parent}",
        ],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    return Build(done.returncode, done.stdout, site_dir)


def copy_of_site_sources(destination: Path) -> Path:
    """mkdocs.yml and docs/ copied into `destination`, to change them there; the notebooks
    and the package (which the build reads) are linked, not copied."""
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO_ROOT / "mkdocs.yml", destination / "mkdocs.yml")
    shutil.copytree(
        REPO_ROOT / "docs", destination / "docs", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("notebooks", "notebook_accel"):
        (destination / name).symlink_to(REPO_ROOT / name, target_is_directory=True)
    return destination


def load_hook(name: str) -> ModuleType:
    """A module of docs/hooks, loaded as MkDocs loads it (from its file)."""
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
