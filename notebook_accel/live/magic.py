"""`%%on_workers`: run a notebook cell on every live worker.

    %%on_workers                 every rank; shows the main rank's last value
    %%on_workers --ranks 0,1     chosen ranks
    %%on_workers --all           a list of every rank's last value
    %%on_workers --timeout 30    interrupt the cell after 30 s (the workers stay up)

It runs on the group most recently started with `start_workers` in this kernel.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from notebook_accel.live.group import LiveWorkers

_current: LiveWorkers | None = None


def register_magic(workers: LiveWorkers) -> None:
    """Make `workers` the group `%%on_workers` runs on; register the magic in IPython."""
    global _current
    _current = workers
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        shell.register_magic_function(on_workers, magic_kind="cell", magic_name="on_workers")


def on_workers(line: str, cell: str) -> Any:
    """Run the cell's code in every live worker's namespace (see the module docstring)."""
    options = _parse(line)
    if _current is None:
        raise RuntimeError(
            "no live workers in this kernel: start them with "
            "`workers = notebook_accel.start_workers(...)` first."
        )
    return _current.run_cell(
        cell, ranks=options.ranks, return_all=options.all, timeout=options.timeout
    )


def _parse(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="%%on_workers", add_help=False, exit_on_error=False)
    parser.add_argument("--ranks", type=_ranks, default=None)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--timeout", type=float, default=None)
    try:
        options, unknown = parser.parse_known_args(shlex.split(line))
    except (argparse.ArgumentError, ValueError) as error:
        raise ValueError(f"%%on_workers {line}: {error}. {_USAGE}") from None
    if unknown:
        raise ValueError(f"%%on_workers does not take {' '.join(unknown)}. {_USAGE}")
    return options


def _ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ranks takes rank numbers separated by commas, got {text!r}"
        ) from None


_USAGE = "Use: %%on_workers [--ranks 0,1] [--all] [--timeout SECONDS]"
