"""The torch releases and Pythons the project is tested on, and whether this one is.

CI runs the whole suite on one torch and a compatibility subset on each end of the
range (tests/torch_range). Outside the range the package still imports and runs; what
it uses of torch's internals is checked where it is used (the other modules of this
package), and `notebook-accel env` says the running torch is untested.
"""

from __future__ import annotations

import sys

# The oldest: torch_xla's last release pins it, and notebook platforms (Colab, Kaggle)
# ship a release of about its age. The newest: the newest installable release.
TESTED_TORCH = ("2.9.0", "2.14.1")
# CI's own torch, on which the whole suite runs.
SUITE_TORCH = "2.13.0"
TESTED_PYTHON = ("3.11",)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.9.0+cu128" -> (2, 9)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def tested_range() -> str:
    """ "torch 2.9 to 2.14" """
    oldest, newest = (release(version) for version in TESTED_TORCH)
    return f"torch {oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}"


def untested(torch_version: str | None = None) -> str | None:
    """What is outside the tested range here (this torch, this Python), or None."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    said = []
    oldest, newest = (release(version) for version in TESTED_TORCH)
    if not oldest <= release(torch_version) <= newest:
        said.append(f"torch {torch_version} is outside the tested {tested_range()}")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python not in TESTED_PYTHON:
        said.append(f"Python {python} is not one of the tested {', '.join(TESTED_PYTHON)}")
    return "; ".join(said) or None
