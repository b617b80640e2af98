"""Every check a launch makes before it starts anything, and the plan it yields.

Each option's own value is checked where it is defined (launch/options.py);
here come the checks that need several options, the function or the
hardware. Each bad input gets an error that names the argument and says what
to do; nothing has been started when one is raised.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from notebook_accel.config.settings import RENDEZVOUS_TIMEOUT_SECONDS, LaunchSettings
from notebook_accel.launch.fresh import resolve_start_method
from notebook_accel.launch.options import CLUSTER_OPTIONS, OPTIONS, check_options
from notebook_accel.platforms.base import LaunchRefused, Platform
from notebook_accel.platforms.hardware import Hardware
from notebook_accel.platforms.registry import default_platform, platform_named
from notebook_accel.platforms.registry import detect_hardware as detect
from notebook_accel.reporting.report import RunReport

if TYPE_CHECKING:
    from notebook_accel.launch.cluster.request import ClusterRequest

DEFAULT_MULTINODE_PORT = 29500
# CPU workers per core beyond which a launch is refused unless oversubscribe=True:
# far past this, a mistyped count (10**6) would fork until the machine gives out.
CPU_WORKERS_PER_CORE_LIMIT = 8


# Where a worker of a resumed detached run finds its checkpoint (resume_checkpoint()).
ENV_RESUME_FROM = "NOTEBOOK_ACCEL_RESUME_FROM"


@dataclass(frozen=True)
class LaunchPlan:
    """A checked launch: everything needed to start the workers."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    platform: Platform
    settings: LaunchSettings
    local_world_size: int
    num_nodes: int
    node_rank: int
    master_addr: str
    port: int | None
    devices: list[int] | None
    max_restarts: int
    timeout: float | None
    return_all: bool
    output: str
    threads_per_process: int
    rendezvous_timeout: float = RENDEZVOUS_TIMEOUT_SECONDS
    # Seconds without progress before the cell shows where each rank is (None: never).
    explain_hang_after: float | None = None
    # A single worker runs in this process unless a caller (the panel, which
    # must be able to stop it) asks for a worker process anyway.
    single_in_process: bool = True
    # Import here, after the run, what the workers imported (launch/warm.py).
    warm: bool = True
    # "fork", "forkserver" (forked from a clean template process started once,
    # launch/template.py) or "spawn" (fresh interpreters, launch/fresh.py); with the
    # reason the fork start could not be used when start_method="auto" chose forkserver.
    start_method: str = "fork"
    fresh_start_reason: str | None = None
    # Where the workers run when not on this machine: a Ray cluster's request
    # (launch/cluster/request.py), with the function and arguments packed for it.
    cluster: ClusterRequest | None = None
    # A worker that raises opens pdb on its frames in the cell (launch/debugging.py).
    post_mortem: bool = False
    # A resumed detached run's checkpoint, which its workers find through
    # resume_checkpoint() (launch/runs).
    resume_from: str | None = None

    @property
    def world_size(self) -> int:
        return self.local_world_size * self.num_nodes

    @property
    def in_process(self) -> bool:
        # A chosen GPU other than the first needs a worker of its own: this
        # process cannot narrow the GPUs it sees after the fact.
        chose_another_gpu = self.devices not in (None, [0])
        on_this_machine = self.cluster is None
        return (
            self.world_size == 1
            and self.single_in_process
            and on_this_machine
            and not chose_another_gpu
        )

    def environment(self, port: int, attempt: int) -> dict[str, str]:
        """Variables every worker of this node gets (the rank ones come per worker)."""
        env = {
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(port),
            # The launching process hosts the store, as torchrun's agent does, so
            # init_process_group(init_method="env://") connects on every rank.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "OMP_NUM_THREADS": str(self.threads_per_process),
        }
        if self.in_process:
            env.update({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "NODE_RANK": "0"})
        env.update(self.settings.to_env())
        if self.resume_from:
            env[ENV_RESUME_FROM] = self.resume_from
        return env

    def new_report(self, started_at: float = 0.0) -> RunReport:
        """An empty report for a run of this plan."""
        return RunReport(
            world_size=self.world_size,
            backend=self.settings.backend,
            mixed_precision=self.settings.mixed_precision,
            start_method="in process" if self.in_process else self.start_method,
            started_at=started_at,
            main_rank=self.node_rank * self.local_world_size,
        )

    def worker_spec(self, port: int, attempt: int):
        from notebook_accel.launch.worker import WorkerSpec

        return WorkerSpec(
            function=self.function,
            args=self.args,
            kwargs=self.kwargs,
            node_rank=self.node_rank,
            local_world_size=self.local_world_size,
            environment=self.environment(port, attempt),
            threads_per_process=self.threads_per_process,
            return_all=self.return_all,
            # Picklable as they are, for workers started in fresh interpreters.
            worker_environment=functools.partial(
                self.platform.worker_environment, devices=self.devices
            ),
            run=self.platform.run_in_worker,
            # A fresh interpreter imports everything itself, whatever this process holds.
            report_imports=self.warm and self.start_method in ("fork", "forkserver"),
            start_method=self.start_method,
            post_mortem=self.post_mortem,
        )


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
    _check_not_in_worker()
    args, kwargs = _check_call(function, args, kwargs)
    if values["cluster"] == "ray":
        return _plan_on_cluster(function, args, kwargs, values)
    _check_cluster_options_unused(values)
    _check_nodes(values)
    hardware = hardware or detect()
    platform, local_processes = choose_workers(values, hardware)
    platform.check_precision(values["mixed_precision"], hardware)
    plan = LaunchPlan(
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
        local_world_size=local_processes,
        num_nodes=values["num_nodes"],
        node_rank=values["node_rank"],
        master_addr=values["master_addr"],
        port=_port(values),
        devices=values["devices"],
        max_restarts=values["max_restarts"],
        timeout=values["timeout"],
        explain_hang_after=values["explain_hang_after"],
        return_all=values["return_all"],
        output=values["output"],
        threads_per_process=values["threads_per_process"] or 1,
        single_in_process=single_in_process and platform.single_worker_in_process,
        warm=values["warm"],
        post_mortem=values["post_mortem"],
    )
    return _check_how_it_runs(plan, values["start_method"])


def _plan_on_cluster(function: Any, args: tuple, kwargs: dict, values: dict) -> LaunchPlan:
    """A launch on a Ray cluster: Ray places the workers (launch/cluster)."""
    from notebook_accel.launch.cluster.plan import place_on_cluster

    platform, request = place_on_cluster(values, function, args, kwargs)
    return LaunchPlan(
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
        local_world_size=request.workers,
        num_nodes=1,
        node_rank=0,
        master_addr=values["master_addr"],
        port=None,
        devices=None,
        max_restarts=values["max_restarts"],
        timeout=values["timeout"],
        explain_hang_after=values["explain_hang_after"],
        return_all=values["return_all"],
        output=values["output"],
        threads_per_process=values["threads_per_process"] or 1,
        single_in_process=False,
        warm=values["warm"],
        post_mortem=values["post_mortem"],
        cluster=request,
    )


def _check_cluster_options_unused(values: dict[str, Any]) -> None:
    """Options of cluster='ray' given for a launch on this machine: say so, not ignore."""
    defaults = {name: OPTIONS[name].default for name in CLUSTER_OPTIONS}
    given = [name for name in CLUSTER_OPTIONS if values[name] != defaults[name]]
    if given:
        raise ValueError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for workers on a Ray "
            "cluster: pass cluster='ray' too, or leave "
            f"{'it' if len(given) == 1 else 'them'} unset."
        )


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
    platform = _choose_platform(values["backend"], devices, hardware)
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
    _check_devices_fit(
        platform,
        num_processes,
        devices,
        platform.device_count(hardware),
        oversubscribe=values.get("oversubscribe", False),
        summary=platform.devices_summary(hardware),
    )
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


def _port(values: dict[str, Any]) -> int | None:
    if values["use_port"] is None and values["num_nodes"] > 1:
        return DEFAULT_MULTINODE_PORT  # the machines must agree on it without talking
    return values["use_port"]


def _check_how_it_runs(plan: LaunchPlan, start_method: str | None) -> LaunchPlan:
    if plan.in_process:
        if plan.timeout is not None:
            raise ValueError(
                "timeout= needs worker processes: with num_processes=1 the function runs "
                "in this process, which cannot stop itself. Use num_processes=2 or more."
            )
        if plan.max_restarts:
            raise ValueError("max_restarts= needs worker processes; use num_processes=2 or more.")
        return plan
    if not hasattr(os, "fork"):
        raise RuntimeError(
            "notebook_launcher starts worker processes the way Linux does, which this "
            "operating system cannot. Use num_processes=1, or run under Linux or WSL."
        )
    method, reason = choose_start_method(
        resolve_start_method(start_method), plan.platform, plan.args, plan.kwargs
    )
    return dataclasses.replace(plan, start_method=method, fresh_start_reason=reason)


def choose_start_method(
    asked: str, platform: Platform, args: tuple = (), kwargs: dict | None = None
) -> tuple[str, str | None]:
    """(the start method, why forking could not work when "auto" chose another).

    Forking is fast and needs nothing pickled, but a forked worker cannot use a
    GPU (or TPU) runtime its parent started, nor a GPU tensor it inherited.
    "auto" then picks "forkserver": workers forked from a clean process started
    once (launch/template.py); "spawn", asked for, starts a fresh interpreter
    per worker. Raises LaunchRefused where the asked method cannot work, before
    anything starts.
    """
    problem = platform.fork_problem() or _device_tensors_problem(platform, args, kwargs or {})
    if asked == "fork":
        if problem:
            raise LaunchRefused(
                f"start_method='fork' cannot work here: {problem}. Leave start_method unset "
                "(or pass 'forkserver') to fork the workers from a clean process started "
                "once, or restart the kernel and touch the device only inside the training "
                "function."
            )
        return "fork", None
    if asked in ("spawn", "forkserver") or problem:
        fresh_problem = platform.fresh_start_problem()
        if fresh_problem:
            because = f"{problem}; " if problem else ""
            raise LaunchRefused(f"The workers cannot start: {because}{fresh_problem}.")
        if asked == "auto":
            return "forkserver", problem
        return asked, None
    return "fork", None


def _device_tensors_problem(platform: Platform, args: tuple, kwargs: dict) -> str | None:
    """Workers of another platform (CPU ones) can be forked from a kernel that uses a
    device, but cannot read a device tensor they inherit."""
    foreign = sorted(held_device_types((args, kwargs)) - {platform.name})
    if foreign:
        return (
            f"the arguments hold tensors on {', '.join(foreign)} devices, which a forked "
            "worker cannot read (workers that start clean get them on the CPU)"
        )
    return None


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


def _check_not_in_worker() -> None:
    if LaunchSettings.from_env() is not None and "RANK" in os.environ:
        raise RuntimeError(
            "notebook_launcher was called inside a launched worker. Call it once, from "
            "the notebook; inside the training function use the Accelerator instead."
        )


def _check_call(function: Any, args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if not callable(function):
        raise TypeError(
            f"notebook_launcher needs a function to run, got {type(function).__name__}."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
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


def _choose_platform(name: Any, devices: list[int] | None, hardware: Hardware) -> Platform:
    if name is None:
        chosen = default_platform(hardware)
        if devices is not None and not chosen.chooses_devices:
            chosen = platform_named("cuda")  # devices= names GPUs where there are none
    else:
        chosen = platform_named(name)
    if devices is not None and not chosen.chooses_devices:
        raise ValueError(
            f"devices= chooses accelerator devices (GPUs); the {chosen.name} backend takes none."
        )
    return chosen


def _check_devices_fit(
    platform: Platform,
    wanted: int,
    devices: list[int] | None,
    available: int,
    oversubscribe: bool = False,
    summary: str = "",
) -> None:
    noun = platform.device_noun
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
        if wanted > limit and not oversubscribe:
            raise ValueError(
                f"{message}: more than {CPU_WORKERS_PER_CORE_LIMIT} workers per {noun} would "
                f"crowd the machine out, so nothing was started. Pass num_processes={limit} "
                "or fewer, or oversubscribe=True if you really mean it."
            )
        warnings.warn(f"{message}; the workers will share them and run slower.", stacklevel=5)
        return
    if summary:
        message += f" ({summary})"
    fewer = " or fewer" if available > 1 else " or leave it unset"
    raise ValueError(f"{message}. Pass num_processes={available}{fewer}.")
