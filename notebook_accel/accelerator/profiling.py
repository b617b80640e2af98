"""`Accelerator.profile()`: torch.profiler around a block, one trace file per process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from notebook_accel.config.kwargs import ProfileKwargs

TRACE_FILE = "profile_{rank}.json"  # Accelerate's name for each process's Chrome trace


@contextlib.contextmanager
def profile(
    settings: ProfileKwargs, process_index: int, barrier: Callable[[], None]
) -> Iterator[Any]:
    """Run the block under `settings.build()`; yield the profiler.

    With `output_trace_dir`, each process writes its Chrome trace there as
    `profile_<rank>.json` when the block ends, then waits for the others, so
    every file exists when any process goes on.
    """
    with settings.build() as profiler:
        yield profiler
    if settings.output_trace_dir is None:
        return
    os.makedirs(settings.output_trace_dir, exist_ok=True)
    path = os.path.join(settings.output_trace_dir, TRACE_FILE.format(rank=process_index))
    profiler.export_chrome_trace(path)
    barrier()
