"""TPU launching: each forked worker becomes one PJRT process.

How torch_xla's own launcher works (torch_xla/_internal/pjrt.py, 2.9):
`xmp.spawn`/`torch_xla.launch` start one process per TPU chip through a
`concurrent.futures.ProcessPoolExecutor`; each process runs
`initialize_multiprocess(local_rank, local_world_size)` (PJRT_LOCAL_PROCESS_*,
and on TPU the topology: TPU_VISIBLE_CHIPS, TPU_PROCESS_BOUNDS,
TPU_PROCESS_PORT, TPU_PROCESS_ADDRESSES, CLOUD_TPU_TASK_ID) and then the
function in one thread per addressable device (`_run_thread_per_device`; two
on a TPU v2/v3 chip).

The process pool is the part a notebook cannot live with: it drops return
values of `xmp.spawn`, turns a worker's exception into a pickled copy without
its output, leaves no way to stop a run short of killing the kernel, and mixes
every worker's output on one stream. So the launcher keeps its own
`WorkerGroup` (fork, output pipes, message channel, teardown, the same on
every backend), and inside each forked worker calls torch_xla's own
per-process code above, with torch_xla's own initialiser. What each worker
does on the device is then exactly what it does under `xmp.spawn`.

Nothing here imports torch_xla in the launching process: a kernel that never
imported it cannot have started its runtime.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

INSTALL_HINT = 'pip install "notebook-accel[xla]"'


def import_torch_xla() -> Any:
    """torch_xla, or an ImportError that says how to install it."""
    try:
        import torch_xla
    except ImportError as error:
        raise ImportError(
            f"The XLA backend (TPUs) needs torch_xla, which is not installed: {INSTALL_HINT} "
            '(on a TPU VM also libtpu: pip install "torch_xla[tpu]"). Colab and Kaggle '
            "TPU runtimes come with it."
        ) from error
    return torch_xla


def runtime_initialized_here() -> bool:
    """Whether this process already started the XLA runtime (used an XLA device).

    Only asked when torch_xla is imported already: a process that never
    imported it has no runtime. `_xla_runtime_is_initialized` is what
    torch_xla's own spawn checks before it forks; it starts nothing.
    """
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return False
    check = getattr(getattr(torch_xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    return bool(check()) if check is not None else False


def run_in_worker(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    local_rank: int,
    local_world_size: int,
) -> Any:
    """Run `function` in this forked worker as PJRT process `local_rank` of `local_world_size`.

    Returns the value of this process's first device (the only one, except
    on TPU v2/v3, where the process's second core runs the same function in
    a second thread).
    """
    import os

    import torch

    import_torch_xla()
    from torch_xla._internal import pjrt

    # Set rather than left to torch_xla's setdefault: a kernel's environment
    # may carry stale values from an earlier run.
    os.environ["PJRT_LOCAL_PROCESS_RANK"] = str(local_rank)
    os.environ["PJRT_LOCAL_PROCESS_COUNT"] = str(local_world_size)
    if local_world_size == 1:
        # What xmp.spawn(nprocs=1) does: one chip, no multi-process topology.
        def initialize(rank: int, world: int) -> None:
            pjrt.initialize_singleprocess()
    else:
        initialize = pjrt.initialize_multiprocess

    def call() -> Any:
        # If the kernel ran a backward pass before the fork, autograd's engine
        # has sized its per-device queues without the XLA device, and the first
        # backward on XLA fails an internal assert (pytorch/xla#4174). Without
        # multithreading the engine runs XLA's backward (lazy tracing anyway) on
        # the calling thread and never looks those queues up.
        torch.autograd.set_multithreading_enabled(False)
        return function(*args, **kwargs)

    results = pjrt._run_thread_per_device(local_rank, local_world_size, call, initialize)
    return results[min(results)]
