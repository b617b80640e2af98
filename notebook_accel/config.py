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
BACKENDS = ("cpu", "cuda", "xla")

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


class ConfigError(ValueError):
    """A launch configuration file with an unknown key or a bad value."""


@dataclass
class LaunchConfig:
    """The choices of a launch, as the panel, the YAML file and the command line hold them.

    Each field is the `notebook_launcher` option of the same name.
    """

    backend: str | None = None
    num_processes: int | None = None
    devices: list[int] | None = None
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    use_port: int | None = None
    max_restarts: int = 0
    timeout: float | None = None
    fsdp: dict | None = None

    def launch_options(self) -> dict:
        """The keyword arguments for `notebook_launcher`."""
        from dataclasses import asdict

        return asdict(self)

    def to_yaml(self) -> str:
        """The configuration as YAML text, one key per line."""
        import yaml

        body = yaml.safe_dump(self.launch_options(), sort_keys=False, default_flow_style=False)
        return "# notebook_accel launch configuration\n" + body

    def save(self, path: str | os.PathLike) -> None:
        """Write the configuration as YAML (to a temporary file first, then renamed)."""
        target = os.fspath(path)
        temporary = f"{target}.tmp{os.getpid()}"
        with open(temporary, "w") as file:
            file.write(self.to_yaml())
        os.replace(temporary, target)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LaunchConfig:
        """Read a YAML file written by `save()`, the panel or `notebook-accel config`."""
        try:
            with open(path) as file:
                text = file.read()
        except FileNotFoundError:
            raise ConfigError(f"no launch configuration at {os.fspath(path)!r}.") from None
        return cls.from_yaml(text, source=os.fspath(path))

    @classmethod
    def from_yaml(cls, text: str, source: str = "<text>") -> LaunchConfig:
        import yaml

        try:
            root = yaml.compose(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{source} is not valid YAML: {error}") from None
        if root is None:
            return cls()
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(f"{source} must be a mapping of option names to values.")
        values = {}
        for key_node, value_node in root.value:
            line = key_node.start_mark.line + 1
            key = key_node.value
            if key not in _FIELD_TYPES:
                import difflib

                close = difflib.get_close_matches(key, list(_FIELD_TYPES), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{source}, line {line}: unknown key {key!r}{hint}")
            value = yaml.safe_load(yaml.serialize(value_node))
            if key == "fsdp":
                values[key] = _fsdp_section(value, line, value_node, source)
                continue
            if not _FIELD_TYPES[key](value):
                raise ConfigError(
                    f"{source}, line {line}: {key}: {value!r} is not {_FIELD_HELP[key]}."
                )
            values[key] = value
        if "mixed_precision" in values:
            values["mixed_precision"] = normalize_precision(values["mixed_precision"])
        return cls(**values)


def normalize_fsdp(value) -> dict | None:
    """The launch's `fsdp` option as plugin fields, or None for no sharding.

    Returns only the fields that differ from the defaults ({}: all defaults).
    Takes None or False (off), True or {} (the defaults), a dict of
    FullyShardedDataParallelPlugin fields, or the plugin itself. Raises
    ValueError on an unknown or bad field.
    """
    from notebook_accel.kwargs import FullyShardedDataParallelPlugin

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


def _fsdp_section(value, key_line: int, node, source: str) -> dict | None:
    """Check the YAML `fsdp:` section; an error names the line of the bad option."""
    import yaml

    try:
        return normalize_fsdp(value)
    except ValueError as error:
        line, problem = key_line, error
        options = node.value if isinstance(node, yaml.MappingNode) else []
        for option_node, option_value in options:
            try:
                normalize_fsdp({option_node.value: yaml.safe_load(yaml.serialize(option_value))})
            except ValueError as option_error:
                line, problem = option_node.start_mark.line + 1, option_error
                break
        raise ConfigError(f"{source}, line {line}: fsdp: {problem}") from None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_TYPES = {
    "backend": lambda v: v is None or v in BACKENDS,
    "num_processes": lambda v: v is None or (_whole(v) and v >= 1),
    "devices": lambda v: v is None or (isinstance(v, list) and all(_whole(d) for d in v)),
    "mixed_precision": lambda v: str(v).lower() in PRECISIONS + ("none", "fp32", "false"),
    "gradient_accumulation_steps": lambda v: _whole(v) and v >= 1,
    "num_nodes": lambda v: _whole(v) and v >= 1,
    "node_rank": lambda v: _whole(v) and v >= 0,
    "master_addr": lambda v: isinstance(v, str) and bool(v.strip()),
    "use_port": lambda v: v is None or (_whole(v) and 1 <= v <= 65535),
    "max_restarts": lambda v: _whole(v) and v >= 0,
    "timeout": lambda v: v is None or (isinstance(v, (int, float)) and v > 0),
    "fsdp": lambda v: True,  # checked field by field by _fsdp_section
}
_FIELD_HELP = {
    "backend": f"one of {', '.join(BACKENDS)} or null",
    "num_processes": "a whole number of at least 1, or null",
    "devices": "a list of GPU indices, or null",
    "mixed_precision": f"one of {', '.join(PRECISIONS)}",
    "gradient_accumulation_steps": "a whole number of at least 1",
    "num_nodes": "a whole number of at least 1",
    "node_rank": "a whole number of at least 0",
    "master_addr": "a host name or IP address",
    "use_port": "a port number (1-65535) or null",
    "max_restarts": "a whole number of at least 0",
    "timeout": "a positive number of seconds, or null",
    "fsdp": "a mapping of FSDP options, true, or null",
}
