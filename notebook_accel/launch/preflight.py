"""Every check a launch makes before it starts anything, and the plan it yields.

Each bad input gets an error that names the argument and says what to do;
nothing has been started when one is raised.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from notebook_accel.config import (
    RENDEZVOUS_TIMEOUT_SECONDS,
    LaunchSettings,
    normalize_fsdp,
    normalize_precision,
)
from notebook_accel.launch import hardware as hardware_module
from notebook_accel.launch.backends import BACKENDS, Backend
from notebook_accel.launch.observers import OUTPUT_CHOICES

DEFAULT_MULTINODE_PORT = 29500

# Options Accelerate's notebook_launcher takes that have no use here; the
# defaults are accepted so that ported code runs unchanged.
_ACCELERATE_ONLY = {
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_conf": None,
    "rdzv_id": "none",
    "monitor_interval": 0.1,
    "log_line_prefix_template": None,
}

_KNOWN_OPTIONS = [
    "function",
    "args",
    "num_processes",
    "mixed_precision",
    "use_port",
    "master_addr",
    "node_rank",
    "num_nodes",
    "kwargs",
    "backend",
    "devices",
    "gradient_accumulation_steps",
    "max_restarts",
    "timeout",
    "return_all",
    "output",
    "threads_per_process",
    "observers",
    "fsdp",
]


@dataclass(frozen=True)
class LaunchPlan:
    """A checked launch: everything needed to start the workers."""

    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    backend: Backend
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
    # A single worker runs in this process unless a caller (the panel, which
    # must be able to stop it) asks for a worker process anyway.
    single_in_process: bool = True

    @property
    def world_size(self) -> int:
        return self.local_world_size * self.num_nodes

    @property
    def in_process(self) -> bool:
        # A chosen GPU other than the first needs a worker of its own: this
        # process cannot narrow the GPUs it sees after the fact.
        chose_another_gpu = self.devices not in (None, [0])
        return self.world_size == 1 and self.single_in_process and not chose_another_gpu

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
        return env

    def worker_spec(self, port: int, attempt: int):
        from notebook_accel.launch.workers import WorkerSpec

        return WorkerSpec(
            function=self.function,
            args=self.args,
            kwargs=self.kwargs,
            node_rank=self.node_rank,
            local_world_size=self.local_world_size,
            environment=self.environment(port, attempt),
            threads_per_process=self.threads_per_process,
            return_all=self.return_all,
            worker_environment=lambda local_rank: self.backend.worker_environment(
                local_rank, self.devices
            ),
            run=self.backend.run_in_worker,
        )


def plan_launch(
    *,
    function: Callable[..., Any],
    args: Any = (),
    kwargs: Any = None,
    num_processes: Any = None,
    mixed_precision: Any = "no",
    use_port: Any = None,
    master_addr: Any = "127.0.0.1",
    node_rank: Any = 0,
    num_nodes: Any = 1,
    backend: Any = None,
    devices: Any = None,
    gradient_accumulation_steps: Any = 1,
    max_restarts: Any = 0,
    timeout: Any = None,
    return_all: bool = False,
    output: Any = "all",
    threads_per_process: Any = None,
    fsdp: Any = None,
    unknown: dict[str, Any] | None = None,
    hardware: hardware_module.Hardware | None = None,
    single_in_process: bool = True,
) -> LaunchPlan:
    """Check every launch input and return the plan, or raise before starting anything."""
    _check_unknown(unknown or {})
    _check_not_in_worker()
    args, kwargs = _check_call(function, args, kwargs)
    num_nodes = _whole_number("num_nodes", num_nodes, minimum=1)
    node_rank = _whole_number("node_rank", node_rank, minimum=0)
    if node_rank >= num_nodes:
        raise ValueError(
            f"node_rank={node_rank} must be below num_nodes={num_nodes}: number the "
            f"machines 0 to {num_nodes - 1}."
        )
    if num_processes is not None:
        num_processes = _whole_number("num_processes", num_processes, minimum=1)
    devices = _check_devices(devices, num_processes)
    if devices is not None and num_processes is None:
        num_processes = len(devices)

    hardware = hardware or hardware_module.detect()
    chosen = _choose_backend(backend, devices, hardware)
    chosen.check_available(hardware)
    if num_nodes > 1 and not chosen.supports_multinode:
        raise ValueError(
            f"num_nodes={num_nodes}: the {chosen.name} backend runs on one machine; "
            "start each machine's processes with its own launcher (for TPU pods, torch_xla's)."
        )
    available = chosen.device_count(hardware)
    if num_processes is None:
        num_processes = chosen.default_num_processes(hardware)
        if num_processes < 1:
            raise RuntimeError(f"this machine has no {chosen.device_noun} to run on.")
    _check_devices_fit(chosen, num_processes, devices, available)
    local_processes = chosen.worker_processes(num_processes, hardware)

    precision = normalize_precision(mixed_precision)
    problem = chosen.precision_problem(precision, hardware)
    if problem:
        raise ValueError(f"mixed_precision={precision!r} cannot run here: {problem}.")
    accumulation = _whole_number(
        "gradient_accumulation_steps", gradient_accumulation_steps, minimum=1
    )
    max_restarts = _whole_number("max_restarts", max_restarts, minimum=0)
    if max_restarts and num_nodes > 1:
        raise ValueError(
            "max_restarts works on one machine only: with num_nodes > 1 a restart would "
            "have to be agreed between machines. Use `notebook-accel launch` (torchrun) "
            "for elastic multi-node runs."
        )
    port = _check_port(use_port, num_nodes)
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ValueError(f"master_addr={master_addr!r} must be a host name or IP address.")
    timeout = _check_timeout(timeout)
    if output not in OUTPUT_CHOICES:
        raise ValueError(f"output={output!r} must be one of {', '.join(OUTPUT_CHOICES)}.")
    threads = (
        1
        if threads_per_process is None
        else _whole_number("threads_per_process", threads_per_process, minimum=1)
    )

    plan = LaunchPlan(
        function=function,
        args=args,
        kwargs=kwargs,
        backend=chosen,
        settings=LaunchSettings(chosen.name, precision, accumulation, fsdp=_check_fsdp(fsdp)),
        local_world_size=local_processes,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr.strip(),
        port=port,
        devices=devices,
        max_restarts=max_restarts,
        timeout=timeout,
        return_all=bool(return_all),
        output=output,
        threads_per_process=threads,
        single_in_process=single_in_process and chosen.single_worker_in_process,
    )
    if plan.in_process:
        if timeout is not None:
            raise ValueError(
                "timeout= needs worker processes: with num_processes=1 the function runs "
                "in this process, which cannot stop itself. Use num_processes=2 or more."
            )
        if max_restarts:
            raise ValueError("max_restarts= needs worker processes; use num_processes=2 or more.")
    else:
        if not hasattr(os, "fork"):
            raise RuntimeError(
                "notebook_launcher forks worker processes, which this operating system "
                "cannot do. Use num_processes=1, or run under Linux or WSL."
            )
        chosen.check_parent_is_clean()
    return plan


def _check_fsdp(fsdp: Any) -> dict | None:
    try:
        return normalize_fsdp(fsdp)
    except ValueError as error:
        raise ValueError(f"fsdp: {error}") from None


def _check_unknown(unknown: dict[str, Any]) -> None:
    for name, value in unknown.items():
        if name in _ACCELERATE_ONLY:
            if value != _ACCELERATE_ONLY[name]:
                raise ValueError(
                    f"{name}={value!r} is an Accelerate option notebook_accel does not use: "
                    "it always meets at a static rendezvous hosted by the launching process. "
                    f"Remove {name}."
                )
            continue
        close = difflib.get_close_matches(name, _KNOWN_OPTIONS + list(_ACCELERATE_ONLY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"notebook_launcher() got an unknown option {name!r}.{hint}")


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


def _whole_number(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}.")
    return value


def _check_devices(devices: Any, num_processes: int | None) -> list[int] | None:
    if devices is None:
        return None
    if isinstance(devices, int) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in devices
    ):
        raise TypeError(f"devices must be a list of GPU indices such as [0, 1], got {devices!r}.")
    devices = list(devices)
    if not devices or len(set(devices)) != len(devices) or min(devices) < 0:
        raise ValueError(f"devices={devices} must list distinct GPU indices, at least one.")
    if num_processes is not None and num_processes != len(devices):
        raise ValueError(
            f"num_processes={num_processes} does not match devices={devices} "
            f"({len(devices)} GPU(s)); one worker runs per device, so pass one of them."
        )
    return devices


def _choose_backend(
    name: Any, devices: list[int] | None, hardware: hardware_module.Hardware
) -> Backend:
    if name is None:
        name = "cuda" if devices is not None else hardware.accelerator
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} must be one of {', '.join(BACKENDS)} (or None).")
    if devices is not None and name != "cuda":
        raise ValueError("devices= chooses GPUs; it needs the cuda backend.")
    return BACKENDS[name]


def _check_devices_fit(
    backend: Backend, wanted: int, devices: list[int] | None, available: int
) -> None:
    noun = backend.device_noun
    if devices is not None and max(devices) >= available:
        raise ValueError(
            f"devices={devices} names GPU {max(devices)}, but this machine has "
            f"{available} GPU(s), numbered 0 to {available - 1}."
        )
    if wanted <= available:
        return
    message = (
        f"num_processes={wanted} asks for one {noun} per worker, but this machine has {available}"
    )
    if backend.oversubscription_allowed():
        warnings.warn(f"{message}; the workers will share them and run slower.", stacklevel=4)
        return
    raise ValueError(f"{message}. Pass num_processes={available} or fewer.")


def _check_port(use_port: Any, num_nodes: int) -> int | None:
    if use_port is None or use_port == "":
        return DEFAULT_MULTINODE_PORT if num_nodes > 1 else None
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        raise ValueError(f"use_port={use_port!r} must be a port number.") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"use_port={port} must be between 1 and 65535.")
    return port


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
    return float(timeout)
