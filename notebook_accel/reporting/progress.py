"""A progress bar for training loops, shown once (on the main process).

Rendering is pluggable: updates `(step, total, elapsed_seconds)` go where this
process's progress goes (reporting/destination.py): a launched worker sends them
to the kernel, which draws them; `set_progress_hook` sends them to a function
of your own. Without either, the bar is drawn with rich, which also renders in
notebooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from notebook_accel.config.settings import process_rank_and_world
from notebook_accel.reporting import destination
from notebook_accel.reporting.destination import ProgressHook

T = TypeVar("T")


def set_progress_hook(hook: ProgressHook | None) -> ProgressHook | None:
    """Send progress updates to `hook` (None: back to rich). Returns the previous hook.

    Inside a launch the hook lasts until the training function ends.
    """
    return destination.replace_progress(hook)


def _is_main_process() -> bool:
    return process_rank_and_world()[0] == 0


def progress_bar(
    iterable: Iterable[T],
    total: int | None = None,
    description: str = "",
    main_process_only: bool = True,
    disable: bool = False,
) -> Iterator[T]:
    """Yield from `iterable`, showing progress on the main process.

    `total` defaults to `len(iterable)` when it has one. Other processes (or
    `disable=True`) just iterate.
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if disable or (main_process_only and not _is_main_process()):
        yield from iterable
        return
    hook = destination.current().progress
    if hook is not None:
        yield from _with_hook(iterable, total, hook)
    else:
        yield from _with_rich(iterable, total, description)


def _with_hook(iterable: Iterable[T], total: int | None, hook: ProgressHook) -> Iterator[T]:
    start = time.perf_counter()
    hook(0, total, 0.0)
    for step, item in enumerate(iterable, start=1):
        yield item
        hook(step, total, time.perf_counter() - start)


def _with_rich(iterable: Iterable[T], total: int | None, description: str) -> Iterator[T]:
    from rich.progress import Progress

    with Progress(transient=False) as progress:
        task: Any = progress.add_task(description or "steps", total=total)
        for item in iterable:
            yield item
            progress.advance(task)
