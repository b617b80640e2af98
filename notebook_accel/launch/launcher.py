"""notebook_launcher: check the inputs, pick the backend, run the workers, return."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from notebook_accel.config.settings import LaunchSettings
from notebook_accel.launch.options import OPTIONS, LaunchConfig, name_positionals
from notebook_accel.launch.preflight import plan_launch
from notebook_accel.launch.running import (  # noqa: F401 - their public place was here
    FreshStartWarning,
    fresh_start_message,
    last_run,
    run_plan,
)
from notebook_accel.reporting.observers import ConsoleObserver, ObserverGroup, RunObserver
from notebook_accel.reporting.report import RunReport


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple | list = (),
    *positional: Any,
    kwargs: dict[str, Any] | None = None,
    config: LaunchConfig | str | os.PathLike | None = None,
    live: bool | None = None,
    observers: list[RunObserver] | None = None,
    detach: bool = False,
    **options: Any,
) -> Any:
    """Run `function(*args)` in one worker process per device and return its result.

    Workers are forked from this process, so a function defined in a notebook
    cell works as it is. CPU workers form a gloo process group, GPU workers an
    nccl one (one GPU each). Every input is checked before anything starts.
    After `args` come Accelerate's positional options (num_processes,
    mixed_precision, use_port, master_addr, node_rank, num_nodes).

    Args:
        function: the training function; it runs once in every worker.
        args: positional arguments for `function`.
        kwargs: keyword arguments for `function`.
        config: a `LaunchConfig` or the path of its YAML file (the panel's
            "Save"); every option passed here wins over the file's.
        live: show progress, metrics and a loss curve while the run goes
            (default: as widgets in a notebook, as text lines in a script).
        observers: extra receivers of the run's events (output, metrics, exits).
        detach: run under a process of its own instead of this kernel's: the run
            goes on if the kernel restarts or dies, and any kernel can `attach()`
            to it (docs/guides/detached-runs.md). Returns a `DetachedRun` at once.

    {options}

    Returns:
        The main worker's return value, tensors moved to the CPU; with
        `return_all`, a list of every worker's value on this node. The run's
        metric history and resource figures are in `last_run()`. With
        `detach`, the run's `DetachedRun` (its `result()` is that value).

    Raises:
        WorkerError: a worker raised, exited non-zero or was killed; it names the
            rank and carries the worker's traceback. The other workers are stopped.
        TimeoutError: `timeout` passed.
        KeyboardInterrupt: the run was interrupted; the workers are stopped.
    """
    given = name_positionals(positional, options)
    if config is not None:  # given means passed, whatever the value: it beats the file's
        config = config if isinstance(config, LaunchConfig) else LaunchConfig.load(config)
        given = {**config.launch_options(), **given}
    # Detached, one worker too gets a process (the kernel may go away), and its options.
    plan = plan_launch(
        function=function, args=args, kwargs=kwargs, single_in_process=not detach, **given
    )
    if detach:  # under a keeper: a process here, or a detached actor of the Ray cluster
        from notebook_accel.launch.runs.handle import start

        run = start(plan)
    extra = list(observers or [])
    if live is None or live:
        from notebook_accel.views.live import WidgetView, live_view

        # A detached run's view, drawn from a thread that follows the run, shows the output
        # too: this cell prints nothing once it has returned.
        view = live_view(plan, force=detach or bool(live), output="open" if detach else "collapsed")
        if detach and isinstance(view, WidgetView):
            view.show()  # under this cell, before it returns
        extra.append(view)
    if not detach:
        console = ConsoleObserver(plan.output, main_rank=plan.node_rank * plan.local_world_size)
        return run_plan(plan, ObserverGroup([console, *extra]))
    if extra:
        run.follow_in_background(ObserverGroup(extra))
    return run


# The options are defined once (launch/options.py); help() and a notebook's
# Shift-Tab show them as keyword parameters, with their defaults and help.
_signature = inspect.signature(notebook_launcher)
notebook_launcher.__signature__ = _signature.replace(
    parameters=[
        p for p in _signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    + [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation
        )
        for name, o in OPTIONS.items()
    ]
)
notebook_launcher.__doc__ = notebook_launcher.__doc__.replace(
    "{options}",
    "\n        ".join(
        ["Launch options (also the keys of a launch file; see LaunchConfig):"]
        + [f"{name} (default {o.default!r}): {o.help}." for name, o in OPTIONS.items()]
    ),
)


def debug_launcher(
    function: Callable[..., Any], args: tuple | list = (), num_processes: int = 2, **options: Any
) -> Any:
    """Run `function(*args)` in `num_processes` CPU worker processes, to test distributed code
    on any machine (Accelerate's `debug_launcher`).

    `notebook_launcher` with `backend="cpu"` and `mixed_precision="no"`, whatever the
    hardware: the workers form a gloo group and `Accelerator()` in them uses the CPU.
    Returns the main worker's value (Accelerate's returns None) and raises
    `WorkerError` as `notebook_launcher` does; other `notebook_launcher` options
    (`timeout=`, `output=`, ...) may be passed too. One process runs in this process.
    """
    for fixed in ("backend", "mixed_precision"):
        if fixed in options:
            raise TypeError(
                f"debug_launcher runs CPU workers without mixed precision; it takes no "
                f"{fixed}=. Use notebook_launcher(..., {fixed}=...) for that."
            )
    return notebook_launcher(
        function, args, num_processes=num_processes, backend="cpu", mixed_precision="no", **options
    )


__all__ = ["notebook_launcher", "last_run", "run_plan", "RunReport", "LaunchSettings"]
