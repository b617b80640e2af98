"""The `ACCELERATE_*` environment variables that `accelerate config` and `accelerate launch`
set, read where Accelerate reads them.

They come below this package's own settings: an argument given in code wins, then
what a launch of ours hands its workers (`notebook_launcher`, `notebook-accel launch`:
LaunchSettings), then these variables, then the defaults. So a script started by
`accelerate launch --mixed_precision bf16` trains in bf16 with either import.

    ACCELERATE_MIXED_PRECISION             Accelerator(mixed_precision=None)
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS Accelerator(gradient_accumulation_steps=None)
    ACCELERATE_USE_CPU                     Accelerator(cpu=False), PartialState(cpu=False)
    ACCELERATE_TORCH_DEVICE                PartialState().device ("cuda:1", "cpu")
    ACCELERATE_DEBUG_MODE                  PartialState().debug (shape checks)
    ACCELERATE_DYNAMO_BACKEND, _MODE, _USE_FULLGRAPH, _USE_DYNAMIC
                                           TorchDynamoPlugin fields left unset
    ACCELERATE_LOG_LEVEL                   get_logger (read in reporting/logging.py)

and the `PARALLELISM_CONFIG_*` ones that `accelerate launch --parallelism_config_*` sets:

    PARALLELISM_CONFIG_DP_REPLICATE_SIZE, _DP_SHARD_SIZE, _TP_SIZE, _CP_SIZE, _SP_SIZE,
    _CP_BACKEND, _SP_BACKEND               ParallelismConfig fields left unset
    PARALLELISM_CONFIG_CP_COMM_STRATEGY    TorchContextParallelConfig(cp_comm_strategy=None),
                                           which ParallelismConfig(cp_size > 1) makes
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "ACCELERATE_"
PARALLELISM_PREFIX = "PARALLELISM_CONFIG_"
DYNAMO_PREFIX = "ACCELERATE_DYNAMO_"
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable, spelled as Accelerate accepts it ("1", "true", "yes", ...)."""
    value = _env(environ).get(name)
    if value is None or value == "":
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(
        f"{name}={value!r} is neither true nor false: set it to one of "
        f"{', '.join(_TRUE)} or {', '.join(_FALSE)}, or unset it."
    )


def mixed_precision(environ: Mapping[str, str] | None = None) -> str | None:
    """ACCELERATE_MIXED_PRECISION ("no", "fp16", "bf16", "fp8"), or None when unset."""
    value = _env(environ).get(PREFIX + "MIXED_PRECISION")
    return value.lower() if value else None


def gradient_accumulation_steps(environ: Mapping[str, str] | None = None) -> int | None:
    """ACCELERATE_GRADIENT_ACCUMULATION_STEPS as a number, or None when unset."""
    name = PREFIX + "GRADIENT_ACCUMULATION_STEPS"
    value = _env(environ).get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number: set it to 1 or more.") from None


def use_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """ACCELERATE_USE_CPU: train on the CPU even where a GPU is."""
    return flag(PREFIX + "USE_CPU", environ=environ)


def torch_device(environ: Mapping[str, str] | None = None) -> str | None:
    """ACCELERATE_TORCH_DEVICE: the device this process trains on, or None when unset."""
    return _env(environ).get(PREFIX + "TORCH_DEVICE") or None


def debug_mode(environ: Mapping[str, str] | None = None) -> bool:
    """ACCELERATE_DEBUG_MODE: check tensor shapes across processes before collectives."""
    return flag(PREFIX + "DEBUG_MODE", environ=environ)


def dynamo_settings(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The TorchDynamoPlugin fields the ACCELERATE_DYNAMO_* variables set (only those set)."""
    env = _env(environ)
    found: dict[str, object] = {}
    if env.get(DYNAMO_PREFIX + "BACKEND"):
        found["backend"] = env[DYNAMO_PREFIX + "BACKEND"]
    if env.get(DYNAMO_PREFIX + "MODE"):
        found["mode"] = env[DYNAMO_PREFIX + "MODE"]
    for field, name in (("fullgraph", "USE_FULLGRAPH"), ("dynamic", "USE_DYNAMIC")):
        if env.get(DYNAMO_PREFIX + name):
            found[field] = flag(DYNAMO_PREFIX + name, environ=env)
    return found


def parallelism_setting(field: str, environ: Mapping[str, str] | None = None) -> str | None:
    """PARALLELISM_CONFIG_<FIELD> ("tp_size" reads PARALLELISM_CONFIG_TP_SIZE), or None
    when unset or empty."""
    return _env(environ).get(PARALLELISM_PREFIX + field.upper()) or None
