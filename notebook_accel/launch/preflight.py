"""Every check a launch makes before it starts anything, and the plan it yields.

Each option's own value is checked where it is defined (launch/options.py);
here come the checks that need several options, the function or the
hardware. Each bad input gets an error that names the argument and says what
to do; nothing has been started when one is raised.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

from notebook_accel.config.settings import LaunchSettings
from notebook_accel.launch.cluster.plan import place_on_cluster
from notebook_accel.launch.options import (
    ENV_START_METHOD,
    START_METHODS,
    check_options,
    check_options_fit_place,
)
from notebook_accel.launch.plan import LaunchPlan
from notebook_accel.launch.supervisor import interrupts_stop
from notebook_accel.platforms.base import LaunchRefused, Platform
from notebook_accel.platforms.hardware import Hardware
from notebook_accel.platforms.registry import default_platform, platform_named
from notebook_accel.platforms.registry import detect_hardware as detect

DEFAULT_MULTINODE_PORT = 29500
# CPU workers per core beyond which a launch is refused unless oversubscribe=True:
# far past this, a mistyped count (10**6) would fork until the machine gives out.
CPU_WORKERS_PER_CORE_LIMIT = 8


def plan_launch(
    *,
    function: Callable[..., Any],
    args: Any = (),
    kwargs: Any = None,
    hardware: Hardware | None = None,
    single_in_process: bool = True,
    **options: Any,
) -> LaunchPlan:
    """Check every launch input and return the plan, or raise before starting anything.

    `options` are `notebook_launcher`'s launch options (launch/options.py);
    `hardware` describes another machine (tests), `single_in_process=False`
    forks even a single worker (the panel, which must be able to stop it).
    """
    values = check_options(options)
    if LaunchSettings.from_env() is not None and "RANK" in os.environ:
        raise RuntimeError(
            "notebook_launcher was called inside a launched worker. Call it once, from "
            "the notebook; inside the training function use the Accelerator instead."
        )
    args, kwargs = _check_call(function, args, kwargs)
    check_options_fit_place(values)
    cluster = None
    if values["cluster"] == "ray":  # Ray places the workers (launch/cluster)
        platform, cluster = place_on_cluster(values, function, args, kwargs)
        local_world_size, single_in_process = cluster.workers, False
    else:
        _check_nodes(values)
        # Raised in the search for device packages, a press can leave the import lock taken
        # for good (python/cpython#74174): it is answered once the search is done.
        with interrupts_stop(None):
            hardware = hardware or detect()
        platform, local_world_size = choose_workers(values, hardware)
        platform.check_precision(values["mixed_precision"], hardware)
        single_in_process = single_in_process and platform.single_worker_in_process
    # The plan's fields named after an option hold its checked value, but for these three.
    same = {f.name: values[f.name] for f in dataclasses.fields(LaunchPlan) if f.name in values}
    same.update(threads_per_process=values["threads_per_process"] or 1, cluster=cluster)
    same.pop("start_method")  # chosen below (with_start_method)
    plan = LaunchPlan(
        **same,
        function=function,
        args=args,
        kwargs=kwargs,
        platform=platform,
        settings=LaunchSettings(
            platform.name,
            values["mixed_precision"],
            values["gradient_accumulation_steps"],
            fsdp=values["fsdp"],
        ),
        local_world_size=local_world_size,
        # Across machines the port is fixed: the machines must agree on it without talking.
        port=values["use_port"] or (DEFAULT_MULTINODE_PORT if values["num_nodes"] > 1 else None),
        single_in_process=single_in_process,
    )
    if plan.in_process:
        if plan.timeout is not None:
            raise ValueError(
                "timeout= needs worker processes: with num_processes=1 the function runs "
                "in this process, which cannot stop itself. Use num_processes=2 or more."
            )
        if plan.max_restarts:
            raise ValueError("max_restarts= needs worker processes; use num_processes=2 or more.")
    if plan.in_process or plan.cluster is not None:  # the cluster's agents fork its workers
        return plan
    if not hasattr(os, "fork"):
        raise RuntimeError(
            "notebook_launcher starts worker processes the way Linux does, which this "
            "operating system cannot. Use num_processes=1, or run under Linux or WSL."
        )
    return with_start_method(plan, values["start_method"])


def choose_workers(values: dict[str, Any], hardware: Hardware) -> tuple[Platform, int]:
    """The platform and the number of worker processes on this machine.

    Shared by `notebook_launcher` and `notebook-accel launch`, so both refuse
    the same inputs with the same messages.
    """
    devices, num_processes = values["devices"], values["num_processes"]
    if devices is not None and num_processes is not None and num_processes != len(devices):
        raise ValueError(
            f"num_processes={num_processes} does not match devices={devices} "
            f"({len(devices)} GPU(s)); one worker runs per device, so pass one of them."
        )
    name = values["backend"]
    platform = default_platform(hardware) if name is None else platform_named(name)
    if devices is not None and not platform.chooses_devices:
        if name is not None:
            raise ValueError(
                f"devices= chooses accelerator devices (GPUs); the {platform.name} backend "
                "takes none."
            )
        platform = platform_named("cuda")  # devices= names GPUs where there are none
    platform.check_available(hardware)
    if values["num_nodes"] > 1 and not platform.supports_multinode:
        raise ValueError(
            f"num_nodes={values['num_nodes']}: the {platform.name} backend runs on one "
            "machine; start each machine's processes with its own launcher (for TPU pods, "
            "torch_xla's)."
        )
    if devices is not None:
        num_processes = len(devices)
    elif num_processes is None:
        num_processes = platform.default_num_processes(hardware)
        if num_processes < 1:
            raise RuntimeError(f"this machine has no {platform.device_noun} to run on.")
    _check_devices_fit(platform, num_processes, values, hardware)
    return platform, platform.worker_processes(num_processes, hardware)


def _check_nodes(values: dict[str, Any]) -> None:
    num_nodes, node_rank = values["num_nodes"], values["node_rank"]
    if node_rank >= num_nodes:
        raise ValueError(
            f"node_rank={node_rank} must be below num_nodes={num_nodes}: number the "
            f"machines 0 to {num_nodes - 1}."
        )
    if values["max_restarts"] and num_nodes > 1:
        raise ValueError(
            "max_restarts works on one machine only: with num_nodes > 1 a restart would "
            "have to be agreed between machines. Use `notebook-accel launch` (torchrun) "
            "for elastic multi-node runs."
        )


def with_start_method(plan: LaunchPlan, asked: str | None) -> LaunchPlan:
    """`plan` with the start method `asked` comes to here (the `start_method` option's help
    says what each does), and why forking could not work when "auto" chose another
    (`fresh_start_reason`); None asks for $NOTEBOOK_ACCEL_START_METHOD, else "auto".
    Raises LaunchRefused where the asked method cannot work, before anything starts.
    """
    if asked is None:
        asked = os.environ.get(ENV_START_METHOD) or "auto"
        if asked not in START_METHODS:
            raise ValueError(
                f"${ENV_START_METHOD}={asked!r} must be one of {', '.join(START_METHODS)}; "
                "unset it for the default."
            )
    # Workers of another platform (CPU ones) can be forked from a kernel that uses a
    # device, but cannot read a device tensor they inherit.
    foreign = sorted(held_device_types((plan.args, plan.kwargs)) - {plan.platform.name})
    problem = plan.platform.fork_problem()
    if foreign and not problem:
        problem = (
            f"the arguments hold tensors on {', '.join(foreign)} devices, which a forked "
            "worker cannot read (workers that start clean get them on the CPU)"
        )
    if asked == "fork" and problem:
        raise LaunchRefused(
            f"start_method='fork' cannot work here: {problem}. Leave start_method unset "
            "(or pass 'forkserver') to fork the workers from a clean process started "
            "once, or restart the kernel and touch the device only inside the training "
            "function."
        )
    method, reason = "fork", None
    if asked in ("spawn", "forkserver") or (asked == "auto" and problem):
        if fresh_problem := plan.platform.fresh_start_problem():
            because = f"{problem}; " if problem else ""
            raise LaunchRefused(f"The workers cannot start: {because}{fresh_problem}.")
        method, reason = ("forkserver", problem) if asked == "auto" else (asked, None)
    return dataclasses.replace(plan, start_method=method, fresh_start_reason=reason)


# Tensors of these device types are plain memory a forked worker can read.
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})


def held_device_types(value: Any, depth: int = 0) -> set[str]:
    """The device types (other than the CPU) of the tensors in `value` (containers and
    modules, a few levels deep)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {value.device.type} - _HOST_DEVICE_TYPES
    if isinstance(value, torch.nn.Module):
        tensors = (*value.parameters(), *value.buffers())
        return {t.device.type for t in tensors} - _HOST_DEVICE_TYPES
    if depth >= 4:
        return set()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        return set().union(*(held_device_types(item, depth + 1) for item in value))
    return set()


def _check_call(function: Any, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a function to run, got {type(function).__name__}."
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple of arguments for the function, got {args!r}; "
            "for a single argument write args=(value,)."
        )
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}.")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without a signature
        return tuple(args), dict(kwargs)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(function, "__name__", "the function")
        raise TypeError(
            f"{name}{signature} cannot be called with args={tuple(args)!r}"
            + (f" and kwargs={kwargs!r}" if kwargs else "")
            + f": {error}. Pass matching arguments."
        ) from None
    return tuple(args), dict(kwargs)


def _check_devices_fit(platform: Platform, wanted: int, values: dict, hardware: Hardware) -> None:
    devices = values["devices"]
    noun, available = platform.device_noun, platform.device_count(hardware)
    if devices is not None and max(devices) >= available:
        raise ValueError(
            f"devices={devices} names {noun} {max(devices)}, but this machine has "
            f"{available} {noun}(s), numbered 0 to {available - 1}."
        )
    if wanted <= available:
        return
    message = (
        f"num_processes={wanted} asks for one {noun} per worker, but this machine has {available}"
    )
    if platform.oversubscription_allowed():
        limit = CPU_WORKERS_PER_CORE_LIMIT * max(available, 1)
        if wanted > limit and not values["oversubscribe"]:
            raise ValueError(
                f"{message}: more than {CPU_WORKERS_PER_CORE_LIMIT} workers per {noun} would "
                f"crowd the machine out, so nothing was started. Pass num_processes={limit} "
                "or fewer, or oversubscribe=True if you really mean it."
            )
        warnings.warn(f"{message}; the workers will share them and run slower.", stacklevel=5)
        return
    if summary := platform.devices_summary(hardware):
        message += f" ({summary})"
    fewer = " or fewer" if available > 1 else " or leave it unset"
    raise ValueError(f"{message}. Pass num_processes={available}{fewer}.")
