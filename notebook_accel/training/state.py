"""Who this process is: rank, world size, device, and the platform it runs on.

The platform (platforms/) holds everything that differs between devices; it
is chosen once, when the state is built, so no other module asks "which
device is this?".
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from notebook_accel.config import accelerate_env
from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.config.settings import LaunchSettings
from notebook_accel.platforms.base import DistributedType, Platform
from notebook_accel.platforms.registry import PLATFORMS, platform_for_process, platform_named
from notebook_accel.training import ops

__all__ = ["AcceleratorState", "DistributedType", "PartialState", "ProcessState"]


class _Place:
    """What follows from a process's rank and world size (both state classes have them)."""

    process_index: int
    num_processes: int
    local_process_index: int

    @property
    def use_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on the process with rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of this machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process with the highest rank."""
        return self.process_index == self.num_processes - 1


@dataclass(frozen=True)
class ProcessState(_Place):
    """This process's place in the run. Built by `ProcessState.create()`."""

    platform: Platform
    process_index: int
    num_processes: int
    local_process_index: int
    local_num_processes: int
    device: torch.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.platform.distributed_type if self.use_distributed else DistributedType.NO

    @classmethod
    def create(
        cls,
        cpu: bool = False,
        launch: LaunchSettings | None = None,
        init_kwargs: InitProcessGroupKwargs | None = None,
    ) -> ProcessState:
        """Read rank and world size from the environment and join the process group.

        Works inside a launched worker, under `torchrun`, and as a plain single
        process (no environment variables: rank 0 of 1). The process group is
        initialised here when the world is larger than one and nobody did it yet.
        """
        platform = _platform(cpu, launch)
        rank, world, local_rank, local_world = platform.placement()
        # Accelerate's ACCELERATE_TORCH_DEVICE comes below a launch of ours, which places
        # each worker on its own device.
        chosen = accelerate_env.torch_device() if launch is None else None
        device = torch.device(chosen) if chosen else platform.device(local_rank)
        if world > 1:
            platform.join(init_kwargs or InitProcessGroupKwargs())
        ops.use_collectives(platform.collectives())
        return cls(platform, rank, world, local_rank, local_world, device)


def _platform(cpu: bool, launch: LaunchSettings | None) -> Platform:
    if cpu:
        return PLATFORMS["cpu"]
    if launch is None:
        return platform_for_process()
    return platform_named(launch.backend)


def _placement_key(platform: Platform) -> tuple:
    """What a state object was built for: a fork, another launch or another device rebuilds it."""
    env = os.environ
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = env.get("WORLD_SIZE"), env.get("RANK"), env.get("LOCAL_RANK"), initialized
    return (os.getpid(), platform.name, *world)


class PartialState(_Place):
    """This process's place in the run, without an Accelerator (Accelerate's `PartialState`).

    Every instance in a process shares one state, as in Accelerate: the first
    creates it (inside a launched worker, joining the process group), the others
    read it. In the kernel, outside any launch, it is rank 0 of 1: on the first
    GPU when one is visible, else on the TPU's first core (`xla:0`, as Accelerate
    does) when the machine has a TPU, else on the CPU. The device is a
    `torch.device` object: neither CUDA nor the XLA runtime is started until it is
    used. A TPU this process cannot use raises, saying why; `cpu=True` chooses
    the CPU on purpose.

        state = PartialState()
        with state.split_between_processes(prompts) as mine:
            answers = [generate(p) for p in mine]
        everything = gather_object(answers)
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = PartialState._shared_state
        init_kwargs = kwargs.get("init_process_group_kwargs")
        launch = LaunchSettings.from_env()
        # Accelerate's ACCELERATE_USE_CPU comes below a launch of ours, which chose the device.
        cpu = cpu or (launch is None and accelerate_env.use_cpu())
        platform = _platform(cpu, launch)
        if self.__dict__.get("_key") == _placement_key(platform):
            return
        process = ProcessState.create(cpu, launch, init_kwargs)
        self.__dict__.clear()
        self.__dict__.update(
            _key=_placement_key(process.platform),
            platform_name=process.platform.name,
            process_index=process.process_index,
            num_processes=process.num_processes,
            local_process_index=process.local_process_index,
            local_num_processes=process.local_num_processes,
            device=process.device,
            distributed_type=process.distributed_type,
            backend=process.platform.process_group_backend if process.use_distributed else None,
        )
        if accelerate_env.debug_mode():
            self.debug = True

    # What the shared state holds once made: asked for after `_reset_state()`, their
    # absence is explained; any other name is an ordinary missing attribute.
    _known_attributes = frozenset(
        {
            "process_index",
            "num_processes",
            "local_process_index",
            "local_num_processes",
            "device",
            "distributed_type",
            "backend",
            "debug",
        }
    )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the shared state lacks. Accelerate's two wordings, which
        # code matches on: its own for a state that was reset, Python's for the rest.
        if name.startswith("__") or name in ("_key", "platform_name"):
            raise AttributeError(name)
        kind = type(self).__name__
        if name in self._known_attributes:
            raise AttributeError(
                f"`{kind}` object has no attribute `{name}`. This happens if "
                f"`{kind}._reset_state()` was called and an `Accelerator` or `{kind}` was "
                "not reinitialized: make a new Accelerator or state object."
            )
        raise AttributeError(f"{kind!r} object has no attribute {name!r}")

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state; the next instance builds it again."""
        cls._shared_state.clear()

    @property
    def initialized(self) -> bool:
        """Whether the shared state exists (False only after `_reset_state()`)."""
        return "platform_name" in self.__dict__

    @property
    def platform(self) -> Platform:
        """The device platform this process runs on (platforms/)."""
        return platform_named(self.platform_name)

    @property
    def debug(self) -> bool:
        """Check that tensors agree in shape across processes before each collective, and
        raise `DistributedOperationException` naming the shapes when they do not."""
        return ops.checking_shapes()

    @debug.setter
    def debug(self, value: bool) -> None:
        ops.check_shapes(bool(value))

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this line."""
        if self.use_distributed:
            self.platform.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, then the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The first process of each machine runs the block first, then the others."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process only (None elsewhere)."""
        return _only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on each machine's first process only."""
        return _only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the last process only."""
        return _only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Any:
        """Decorator: run `function` on process `process_index` only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ValueError("on_process needs process_index=...")
        return _only_if(function, lambda: self.process_index == process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of `inputs`.

        Lists, tuples, tensors (along dim 0), dicts of them (each value split
        alike) and datasets with `select` (Hugging Face `datasets`). The first
        `len % num_processes` processes get one item more; with
        `apply_padding=True` the shorter shares repeat the last item, so every
        share has the same length and `gather` works (drop the extra items
        after gathering: keep the first `len(inputs)`).
        """
        yield split_between(inputs, self.process_index, self.num_processes, apply_padding)

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the process group (the launcher also does it when the function returns)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.use_distributed:
                self.platform.barrier()
            torch.distributed.destroy_process_group(group)

    def __repr__(self) -> str:
        if not self.initialized:
            return f"{type(self).__name__}(reset)"
        return (
            f"Distributed environment: {self.distributed_type}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )


class AcceleratorState(PartialState):
    """The process state an `Accelerator` holds, with its precision (Accelerate's name).

    Shared by every instance in a process, like `PartialState`, and built from
    it. `AcceleratorState._reset_state()` forgets it: an Accelerator made before
    then raises a clear AttributeError at its next use.
    """

    _shared_state: dict[str, Any] = {}
    _known_attributes = PartialState._known_attributes | {"mixed_precision", "fsdp_plugin"}

    def __init__(
        self, cpu: bool = False, mixed_precision: str | None = None, **kwargs: Any
    ) -> None:
        self.__dict__ = AcceleratorState._shared_state
        partial = PartialState(cpu, **kwargs)
        if self.__dict__.get("_key") != partial._key:
            self.__dict__.clear()
            self.__dict__.update(partial.__dict__, mixed_precision="no")
        if mixed_precision is not None:
            self.mixed_precision = mixed_precision

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the shared state (and PartialState's with `reset_partial_state=True`)."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    def use_fsdp_plugin(self, plugin: Any) -> None:
        """Record the newest Accelerator's FSDP plugin (or None): while one shards the
        models of several processes, `distributed_type` is FSDP, as in Accelerate."""
        self.fsdp_plugin = plugin
        if not self.use_distributed:
            self.distributed_type = DistributedType.NO
        elif plugin is not None:
            self.distributed_type = DistributedType.FSDP
        else:
            self.distributed_type = self.platform.distributed_type

    def __repr__(self) -> str:
        text = super().__repr__()
        if self.initialized:
            text += f"\nMixed precision type: {self.mixed_precision}\n"
        return text


def _only_if(function: Callable, condition: Callable[[], bool]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if condition() else None

    return wrapper


def split_between(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    """Process `rank`'s contiguous share of `inputs` (see `split_between_processes`)."""
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes needs every value of the dict to have the same length."
            )
        return type(inputs)(
            {key: split_between(value, rank, world, pad) for key, value in inputs.items()}
        )
    is_dataset = (
        not isinstance(inputs, (list, tuple, torch.Tensor))
        and callable(getattr(inputs, "select", None))
        and hasattr(inputs, "__len__")
    )
    if not (is_dataset or isinstance(inputs, (list, tuple, torch.Tensor))):
        raise TypeError(
            f"split_between_processes splits lists, tuples, tensors, datasets and dicts of "
            f"them, not {type(inputs).__name__}."
        )
    if world == 1:
        return inputs
    share, extra = divmod(len(inputs), world)
    start = rank * share + min(rank, extra)
    end = start + share + (rank < extra)
    missing = (share + (extra > 0)) - (end - start) if pad else 0
    if is_dataset:  # rows chosen by index; padding repeats the last row
        return inputs.select(list(range(start, end)) + [len(inputs) - 1] * missing)
    part = inputs[start:end]
    if not missing:
        return part
    if isinstance(part, torch.Tensor):
        filler = inputs[-1:].expand(missing, *inputs.shape[1:])
        return torch.cat([part, filler])
    return part + type(part)([inputs[-1]] * missing)
