"""Where this process's metric records, progress updates and milestones go.

One place for it: `Accelerator.log` and `progress_bar` ask `current()`, and
whoever runs a training function installs a `Destination` around it with
`sending_to()`: a launched worker's runtime (down its channel to the
launching process), or the launcher's in-process path (`num_processes=1`,
straight into the run's report). With nothing installed, records are kept in
`metrics.local_history()` and progress is drawn with rich.

A milestone is a moment when a training function has likely imported what
its training needs (`prepare()` done, the first optimizer step): a launched
worker then tells the launcher which modules it imported, so that the
launcher can import them while the run goes (launch/warm.py).

The current destination is process-wide, not per thread, so that a training
function's own helper threads log to its run too. Swapping it is a plain
assignment: no lock that a fork could leave held in a child.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from notebook_accel.reporting.events import MetricRecord

# (step, total, elapsed_seconds) from a progress bar.
ProgressHook = Callable[[int, "int | None", float], None]


@dataclasses.dataclass(frozen=True)
class Destination:
    """Receivers of metric records, progress updates, milestones and the paths of saved
    checkpoints; None: the default for that kind (milestones and checkpoints: nothing)."""

    metric: Callable[[MetricRecord], None] | None = None
    progress: ProgressHook | None = None
    milestone: Callable[[], None] | None = None
    checkpoint: Callable[[str], None] | None = None


_current = Destination()


def current() -> Destination:
    """Where metrics and progress made in this process go right now."""
    return _current


def milestone() -> None:
    """Mark a moment when the training function has imported what it trains with."""
    hook = _current.milestone
    if hook is not None:
        hook()


def checkpoint_saved(path: str) -> None:
    """Tell the launcher that a complete checkpoint is at `path` (the main process's)."""
    hook = _current.checkpoint
    if hook is not None:
        hook(path)


@contextmanager
def sending_to(destination: Destination) -> Iterator[Destination]:
    """Send this process's metrics and progress to `destination` for the block, then restore."""
    global _current
    previous, _current = _current, destination
    try:
        yield destination
    finally:
        _current = previous


def replace_progress(hook: ProgressHook | None) -> ProgressHook | None:
    """Send progress to `hook` from now on (until the enclosing `sending_to` ends).

    Returns the hook it replaces.
    """
    global _current
    previous = _current.progress
    _current = dataclasses.replace(_current, progress=hook)
    return previous
