"""The settings a launch hands to its workers.

The launcher writes them into each worker's environment; `Accelerator()` reads
them back, so a worker picks up the launch's precision and accumulation without
arguments. Environment variables (rather than a module global) also reach code
started by `torch.distributed.run`, which the command line uses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

PRECISIONS = ("no", "fp16", "bf16", "fp8")

ENV_BACKEND = "NOTEBOOK_ACCEL_BACKEND"
ENV_MIXED_PRECISION = "NOTEBOOK_ACCEL_MIXED_PRECISION"
ENV_GRADIENT_ACCUMULATION_STEPS = "NOTEBOOK_ACCEL_GRADIENT_ACCUMULATION_STEPS"
ENV_FSDP = "NOTEBOOK_ACCEL_FSDP"  # the FSDP plugin's fields as JSON; unset: no sharding
ENV_RENDEZVOUS_TIMEOUT = "NOTEBOOK_ACCEL_RENDEZVOUS_TIMEOUT"
# How long processes wait for each other when they form the process group.
RENDEZVOUS_TIMEOUT_SECONDS = 120.0


def process_rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, without importing torch.

    The process group answers when it is up (and torch is loaded); otherwise the
    variables a launcher (ours or torchrun) set; outside any launch, (0, 1).
    """
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def normalize_precision(value: str | None) -> str:
    """Return a canonical precision name, or raise a ValueError naming the choices."""
    if value is None:
        return "no"
    name = str(value).lower()
    if name in ("none", "fp32", "false"):
        name = "no"
    if name not in PRECISIONS:
        raise ValueError(
            f"mixed_precision={value!r} is not a precision this toolkit knows; "
            f"choose one of {', '.join(PRECISIONS)}."
        )
    return name


@dataclass(frozen=True)
class LaunchSettings:
    """What a launched worker should use unless its code says otherwise."""

    backend: str = "cpu"
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    # FullyShardedDataParallelPlugin fields (None: no sharding).
    fsdp: dict | None = field(default=None, hash=False)

    def to_env(self) -> dict[str, str]:
        """The environment variables a worker reads these settings back from."""
        env = {
            ENV_BACKEND: self.backend,
            ENV_MIXED_PRECISION: self.mixed_precision,
            ENV_GRADIENT_ACCUMULATION_STEPS: str(self.gradient_accumulation_steps),
        }
        if self.fsdp is not None:
            env[ENV_FSDP] = json.dumps(self.fsdp)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchSettings | None:
        """The settings of the launch this process belongs to, or None outside a launch."""
        env = os.environ if environ is None else environ
        if ENV_BACKEND not in env:
            return None
        return cls(
            backend=env[ENV_BACKEND],
            mixed_precision=normalize_precision(env.get(ENV_MIXED_PRECISION)),
            gradient_accumulation_steps=int(env.get(ENV_GRADIENT_ACCUMULATION_STEPS, "1")),
            fsdp=json.loads(env[ENV_FSDP]) if env.get(ENV_FSDP) else None,
        )


def normalize_fsdp(value) -> dict | None:
    """The launch's `fsdp` option as plugin fields, or None for no sharding.

    Returns only the fields that differ from the defaults ({}: all defaults).
    Takes None or False (off), True or {} (the defaults), a dict of
    FullyShardedDataParallelPlugin fields, or the plugin itself. Raises
    ValueError on an unknown or bad field.
    """
    from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin

    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if isinstance(value, Mapping):
        value = FullyShardedDataParallelPlugin.from_dict(dict(value))
    if not isinstance(value, FullyShardedDataParallelPlugin):
        raise ValueError(
            f"fsdp={value!r} must be true, a dict of FullyShardedDataParallelPlugin fields, "
            "or a FullyShardedDataParallelPlugin."
        )
    defaults = FullyShardedDataParallelPlugin().to_dict()
    return {key: item for key, item in value.to_dict().items() if item != defaults[key]}
