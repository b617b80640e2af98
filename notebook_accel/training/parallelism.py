"""Accelerate's `ParallelismConfig`: the sizes of each kind of parallelism, and the device
mesh they make.

The processes are laid out on one `torch.distributed.device_mesh.DeviceMesh` whose
dimensions are named, outermost first, "dp_replicate", "dp_shard", "cp", "tp"
(torchtitan's `ParallelDims` order, as Accelerate's): ranks that differ only in
their "tp" (and "cp") coordinate hold the same batch, so the data loader shards
over the data-parallel ranks alone (`data_parallel_rank`). `prepare()` shards a
model with FSDP2 over "dp_shard", replicated over "dp_replicate" when both are
larger than 1 (HSDP: shard inside a group, e.g. a node, and replicate across
groups); with "dp_replicate" alone the model is wrapped in DDP, as without a
config.

With `tp_size` > 1 `prepare()` splits the model's tensors over "tp"
(tensor_parallel.py: by a plan given to it, or a transformers model's own), unless
they come split (transformers' `from_pretrained(..., tp_plan="auto", device_mesh=...)`,
or the user's `parallelize_module`), and then shards the split model over the
data-parallel dimensions (FSDP2 x TP). With `cp_size`
> 1 the ranks of a "cp" group read the same batch and split its sequences inside
`accelerator.maybe_context_parallel(buffers, buffer_seq_dims)` (torch's context
parallelism: SDPA attention on CUDA; on CPU torch has no kernel for it, which the
error says), keys and values passed between them as the `cp_handler`'s
`cp_comm_strategy` says; FSDP2 shards over "dp_shard" x "cp". DeepSpeed's sequence
parallelism (`sp_size`) is refused.

As in Accelerate, the mesh also holds three flattened dimensions: "dp" (dp_replicate x
dp_shard: the ranks that read different batches), "dp_shard_cp" (dp_shard x cp: what
FSDP2 shards over) and "dp_cp" (dp_replicate x dp_shard x cp: what a loss is averaged
over), each of the enabled dimensions only; `mesh["dp"].get_group()` is the
data-parallel group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from notebook_accel.config import accelerate_env
from notebook_accel.config.kwargs import TorchContextParallelConfig
from notebook_accel.internals.context_parallel import require_rotate_method, set_rotate_method
from notebook_accel.internals.mesh import flatten, require_flatten

# Outermost first: neighbouring ranks differ in the innermost dimension.
MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass
class ParallelismConfig:
    """How the processes split the work (Accelerate's class and argument names).

    Args:
        dp_replicate_size: data-parallel replicas (with `dp_shard_size` > 1: HSDP,
            each replica one sharded group). Default 1, or
            `$PARALLELISM_CONFIG_DP_REPLICATE_SIZE` (each field left unset reads its
            `PARALLELISM_CONFIG_*` variable, as in Accelerate).
        dp_shard_size: processes each model is sharded over with FSDP2.
        tp_size: processes each tensor is split over (tensor parallel); the model
            is split before `prepare()`.
        cp_size: processes each sequence is split over (context parallel: SDPA
            attention on CUDA), inside `accelerator.maybe_context_parallel(...)`.
        cp_backend: "torch", as in Accelerate.
        sp_size: DeepSpeed's sequence parallel size; only 1.
        sp_backend: "deepspeed", as in Accelerate.
        tp_handler: accepted as in Accelerate.
        cp_handler: a `TorchContextParallelConfig` (its `cp_comm_strategy`); with
            `cp_size` > 1 and none given, one with the defaults, which reads
            `$PARALLELISM_CONFIG_CP_COMM_STRATEGY`.
        sp_handler: accepted as in Accelerate.
        device_mesh: the mesh, once built (`get_device_mesh`).

    The sizes must multiply to the number of processes; a config whose sizes are
    all 1 means plain data parallelism over every process (DDP).
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    device_mesh: Any = field(default=None, repr=False, compare=False)
    # "dp", "dp_shard_cp", "dp_cp" as flattening returned them (internals/mesh.py: why)
    _flattened: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        setting = accelerate_env.parallelism_setting
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            value = getattr(self, f"{name}_size")
            if value is None:
                value = setting(f"{name}_size") or "1"
            setattr(self, f"{name}_size", _size(f"{name}_size", value))
        self.cp_backend = self.cp_backend or setting("cp_backend") or "torch"
        self.sp_backend = self.sp_backend or setting("sp_backend") or "deepspeed"
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend={self.cp_backend!r}: the one backend is 'torch'.")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend={self.sp_backend!r}: the one backend is 'deepspeed'.")
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(
                f"cp_size={self.cp_size} and sp_size={self.sp_size}: context and sequence "
                "parallelism exclude each other; set one of them to 1."
            )
        if (self.tp_size > 1 or self.cp_size > 1) and self.dp_replicate_size > 1:
            if self.dp_shard_size == 1:
                raise ValueError(
                    f"dp_replicate_size={self.dp_replicate_size} with tp_size={self.tp_size} "
                    f"and cp_size={self.cp_size}: tensor or context parallelism cannot be "
                    "composed with plain data parallelism (DDP). Shard instead: set "
                    "dp_shard_size to the data-parallel size (FSDP2 + TP), or both "
                    "dp_replicate_size and dp_shard_size above 1 (HSDP + TP)."
                )
        if self.sp_size > 1:
            raise NotImplementedError(
                f"sp_size={self.sp_size}: sequence parallelism is DeepSpeed's (Ulysses), and "
                "notebook_accel does not use DeepSpeed; shard with dp_shard_size instead."
            )
        if self.cp_enabled:
            self._check_cp_handler()
        layout = ", ".join(f"{name}_size={size}" for name, size in self._sizes.items())
        if self.dp_cp_dim_names:  # the names flattened into "dp", "dp_shard_cp" and "dp_cp"
            require_flatten(f"ParallelismConfig({layout})")
        if self.cp_enabled:
            require_rotate_method(f"ParallelismConfig({layout})")

    def _check_cp_handler(self) -> None:
        if self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        elif not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise ValueError(
                f"cp_handler must be a TorchContextParallelConfig for cp_backend='torch', "
                f"not {type(self.cp_handler).__name__}: pass "
                "TorchContextParallelConfig(cp_comm_strategy='allgather' or 'alltoall')."
            )

    # -- sizes and names (Accelerate's properties) -----------------------------------

    @property
    def _sizes(self) -> dict[str, int]:
        return {name: getattr(self, f"{name}_size") for name in MESH_ORDER}

    @property
    def total_size(self) -> int:
        """The product of every size: the number of processes it needs."""
        total = 1
        for size in self._sizes.values():
            total *= size
        return total

    @property
    def data_parallel_size(self) -> int:
        """How many different batches a step trains on: dp_replicate x dp_shard."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        """Processes that share one batch: tp x cp x sp."""
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether data-parallel replicas is used (dp_replicate_size > 1)."""
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Whether FSDP2 sharding is used (dp_shard_size > 1)."""
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor parallelism is used (tp_size > 1)."""
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        """Whether context parallelism is used (cp_size > 1)."""
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        """Whether sequence parallelism is used (sp_size > 1)."""
        return self.sp_size > 1

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled dimensions data parallelism runs over."""
        return [name for name in ("dp_replicate", "dp_shard") if self._sizes[name] > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks get the same batch."""
        return [name for name in ("tp", "cp", "sp") if self._sizes[name] > 1]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions flattened into "dp_shard_cp", which FSDP2 shards over
        (context-parallel ranks hold the model's shards too)."""
        return [name for name in ("dp_shard", "cp") if self._sizes[name] > 1]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions flattened into "dp_cp": every rank that reads its own
        part of the data, context-parallel ones included (what a loss is averaged over)."""
        return [name for name in ("dp_replicate", "dp_shard", "cp") if self._sizes[name] > 1]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dimensions FSDP2 runs over: replicated (HSDP) and sharded. Without cp the
        shard dimension is "dp_shard" itself: torch deprecates slicing a flattened
        dimension out of the whole mesh, which "dp_shard_cp" needs only with cp."""
        names = ["dp_replicate"] if self.dp_replicate_enabled else []
        if self.cp_enabled:
            return [*names, "dp_shard_cp"]
        return names + (["dp_shard"] if self.dp_shard_enabled else [])

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension, outermost first."""
        return [name for name in MESH_ORDER if self._sizes[name] > 1]

    # -- for a group of processes -------------------------------------------------------

    def check_world(self, world_size: int) -> None:
        """Raise, saying what to change, unless the sizes fit `world_size` processes. A
        config whose sizes are all 1 becomes data parallelism over all of them."""
        if self.total_size == 1 and world_size > 1:
            self.dp_replicate_size = world_size
        if self.total_size != world_size:
            sizes = " x ".join(f"{name}_size={size}" for name, size in self._sizes.items())
            raise ValueError(
                f"ParallelismConfig needs {self.total_size} processes ({sizes}), but "
                f"{world_size} train: make the sizes multiply to {world_size}, or launch "
                f"num_processes={self.total_size}."
            )

    def data_parallel_rank(self, rank: int) -> int:
        """Which data-parallel rank global `rank` is (which part of the data it reads)."""
        return rank // self.non_data_parallel_size

    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]] | tuple[()]:
        """`init_device_mesh`'s names and shape: the enabled dimensions, outermost first;
        () with none enabled (Accelerate's private method, kept for code that calls it)."""
        names = tuple(self.active_mesh_dims)
        if not names:
            return ()
        return names, tuple(self._sizes[name] for name in names)

    def build_device_mesh(self, device_type: str) -> Any:
        """The mesh of the enabled dimensions (None with none enabled), with the
        flattened dimensions "dp", "dp_shard_cp" and "dp_cp" of those enabled."""
        from torch.distributed.device_mesh import init_device_mesh

        layout = self._get_mesh()
        if not layout:
            return None
        names, shape = layout
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        flattened = {
            "dp": self.dp_dim_names,
            "dp_shard_cp": self.dp_shard_cp_dim_names,
            "dp_cp": self.dp_cp_dim_names,
        }
        for flat_name, dims in flattened.items():
            if dims:  # sliced by the list of names, as Accelerate slices it
                self._flattened[flat_name] = flatten(mesh[dims], flat_name)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """The mesh, built on first use for `device_type` ("cpu", "cuda")."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("get_device_mesh() builds the mesh first: pass device_type.")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"the mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}."
            )
        return self.device_mesh

    def fsdp_mesh(self, device_type: str) -> Any:
        """The mesh FSDP2 shards over: 1-D (FSDP) or 2-D replicate x shard (HSDP)."""
        mesh = self.get_device_mesh(device_type)
        names = self.fsdp_dim_names
        if names == ["dp_shard_cp"]:
            # kept from flattening: torch deprecates slicing it out of the whole mesh
            return self._flattened["dp_shard_cp"]
        # With cp, HSDP still slices "dp_shard_cp" out (torch warns): torch has no other
        # way to pair a flattened dimension with another.
        return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


# What torch says where its context parallelism has no kernel (SDPA on CPU).
_NO_STRATEGY = "does not have a sharding strategy registered"


@contextlib.contextmanager
def split_sequences(
    mesh: Any,
    buffers: list[Any] | None,
    buffer_seq_dims: list[int] | None,
    no_restore_buffers: set[Any] | None,
    cp_comm_strategy: str = "allgather",
) -> Iterator[None]:
    """torch's context parallelism over `mesh` (the "cp" dimension): `buffers` are split
    along their sequence dimensions among its ranks while the block runs, and SDPA
    attention exchanges the keys and values it needs (ring attention), by
    `cp_comm_strategy`."""
    from torch.distributed.tensor.experimental import context_parallel

    set_rotate_method(cp_comm_strategy)  # a setting of torch's, for the whole process
    try:
        with context_parallel(
            mesh,
            buffers=buffers,
            buffer_seq_dims=buffer_seq_dims,
            no_restore_buffers=no_restore_buffers,
        ):
            yield
    except NotImplementedError as error:
        if _NO_STRATEGY not in str(error):
            raise
        raise NotImplementedError(
            f"context parallelism cannot run this operation here ({error}). torch's "
            "context parallelism splits SDPA attention on CUDA (its flash and efficient "
            "kernels); on CPU, torch 2.13 has no sharding strategy for its attention. Train "
            "with cp_size on GPUs, or shard the model over more processes (dp_shard_size) "
            "and use shorter sequences."
        ) from error


def first_of_each_data_parallel_rank(per_rank: Any, config: ParallelismConfig) -> Any:
    """From one value per rank (a list, or a tensor's first dimension), those of the ranks
    that lead their tensor- or context-parallel group (the others hold the same batch's
    results)."""
    return per_rank[:: config.non_data_parallel_size]


def _size(name: str, value: Any) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a whole number of processes.") from None
    whole = isinstance(value, str) or size == value  # "2" from a variable, or 2 (not 1.5)
    if isinstance(value, bool) or not whole or size < 1:
        raise ValueError(f"{name}={value!r} must be a whole number, at least 1.")
    return size
