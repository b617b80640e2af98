"""The settings a launch hands to its workers.

The launcher writes them into each worker's environment; `Accelerator()` reads
them back, so a worker picks up the launch's precision and accumulation without
arguments. Environment variables (rather than a module global) also reach code
started by `torch.distributed.run`, which the command line uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PRECISIONS = ("no", "fp16", "bf16", "fp8")
BACKENDS = ("cpu", "cuda", "xla")

ENV_BACKEND = "NOTEBOOK_ACCEL_BACKEND"
ENV_MIXED_PRECISION = "NOTEBOOK_ACCEL_MIXED_PRECISION"
ENV_GRADIENT_ACCUMULATION_STEPS = "NOTEBOOK_ACCEL_GRADIENT_ACCUMULATION_STEPS"


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

    def to_env(self) -> dict[str, str]:
        return {
            ENV_BACKEND: self.backend,
            ENV_MIXED_PRECISION: self.mixed_precision,
            ENV_GRADIENT_ACCUMULATION_STEPS: str(self.gradient_accumulation_steps),
        }

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
        )
