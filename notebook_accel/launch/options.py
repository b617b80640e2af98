"""Every launch option, defined once: name, default, help and check.

`notebook_launcher`'s signature and checks, the YAML launch file
(`LaunchConfig`), the panel's fields and the command line's flags are all
derived from `OPTIONS`. Each bad value has one message, whoever finds it:
"num_processes=0 must be at least 1." (a file adds its name and line).

An option counts as given only when the caller passed it: an explicit value
equal to the default still beats the file's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from notebook_accel.config.settings import PRECISIONS, normalize_fsdp, normalize_precision
from notebook_accel.launch.cluster.request import CLUSTERS, STRATEGIES
from notebook_accel.platforms.families import FAMILIES
from notebook_accel.platforms.registry import PLATFORMS
from notebook_accel.reporting.observers import OUTPUT_CHOICES

# The names `start_method` takes; "auto" forks unless the kernel can no longer,
# then uses "forkserver".
START_METHODS = ("auto", "fork", "forkserver", "spawn")
# Set to "fork", "forkserver" or "spawn" to change what start_method=None means
# (tests run the launcher's suite under each this way).
ENV_START_METHOD = "NOTEBOOK_ACCEL_START_METHOD"

# Workers that show no progress for this long are probably stuck: show where they are.
HANG_AFTER_SECONDS = 120.0

# Options Accelerate's notebook_launcher takes that have no use here; the
# defaults are accepted so that ported code runs unchanged.
ACCELERATE_ONLY = {
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_conf": None,
    "rdzv_id": "none",
    "monitor_interval": 0.1,
    "log_line_prefix_template": None,
}


@dataclass(frozen=True)
class Option:
    """One launch option."""

    name: str
    default: Any
    help: str
    # (value) -> the canonical value; raises TypeError/ValueError naming the option.
    check: Callable[[Any], Any]
    annotation: str = "Any"
    # Saved in the YAML launch file, offered by `notebook-accel config`.
    saved: bool = True
    # Accelerate's notebook_launcher takes it in this position (after function, args).
    positional: bool = False
    choices: tuple[str, ...] | None = None
    minimum: int | None = None
    # How the command line turns the flag's text into a value (None: no flag).
    parse: Callable[[str], Any] | None = str
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# -- the checks, each with its one message ----------------------------------------------


def _port(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError(f"use_port={value!r} must be a port number.")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"use_port={value!r} must be a port number.") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"use_port={port} must be between 1 and 65535.")
    return port


def _address(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"master_addr={value!r} must be a host name or IP address.")
    return value.strip()


def _devices(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (int, str)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    ):
        raise TypeError(f"devices must be a list of GPU indices such as [0, 1], got {value!r}.")
    devices = list(value)
    if not devices or len(set(devices)) != len(devices) or min(devices) < 0:
        raise ValueError(f"devices={devices} must list distinct GPU indices, at least one.")
    return devices


def _fsdp(value: Any) -> dict | None:
    try:
        return normalize_fsdp(value)
    except ValueError as error:
        raise ValueError(f"fsdp: {error}") from None


def _ray_address(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"ray_address must be a string such as 'auto', got {value!r}.")
    address = value.strip()
    if address != "auto" and host_and_port(address) is None:
        raise ValueError(
            f"ray_address={value!r} must be 'auto' (the cluster `ray start` runs on "
            "this machine), 'host:port' (the head node's GCS, port 6379 by default) or "
            "'ray://host:port' (Ray Client, port 10001 by default)."
        )
    return address


def host_and_port(address: str) -> tuple[str, int] | None:
    """The host and port of a Ray address ('host:port' or 'ray://host:port'), else None."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


# The command line's parsers raise ArgumentTypeError: argparse shows its text as it is.


def _yes_no(text: str) -> bool:
    answer = text.strip().lower()
    if answer not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return answer in ("true", "yes", "on", "1")


def _index_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GPU indices separated by commas, such as 0,1; got {text!r}"
        ) from None


# -- the options --------------------------------------------------------------------------

# The backends every machine may name; a device type registered with torch in
# this process (a PrivateUse1 device) is accepted too (platforms.platform_named).
_BACKENDS = tuple(dict.fromkeys([*sorted(PLATFORMS), *FAMILIES]))


def _backend(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value):
        return value  # which device types exist is the platform registry's answer
    raise ValueError(
        f"backend={value!r} must be a device type's name: one of {', '.join(_BACKENDS)}, a "
        "device type registered with torch, or None (this machine's default)."
    )


def _count(name: str, default: int | None, help: str, minimum: int, **more: Any) -> Option:
    """A whole-number option (None allowed where it is the default)."""

    def check(value: Any) -> Any:
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a whole number, got {value!r}.")
        if value < minimum:
            raise ValueError(f"{name}={value} must be at least {minimum}.")
        return value

    annotation = "int | None" if default is None else "int"
    return Option(name, default, help, check, annotation, **{"parse": int, **more}, minimum=minimum)


def _decimal(
    name: str,
    default: float | None,
    help: str,
    must_be: str,
    optional: bool = False,
    zero: bool = False,
) -> Option:
    """A number option (seconds, CPUs): above 0, or 0 too with `zero`."""

    def check(value: Any) -> float | None:
        if value is None and optional:
            return None
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or value < 0 or (value == 0 and not zero):
            raise ValueError(f"{name}={value!r} must be {must_be}.")
        return float(value)

    annotation = "float | None" if optional else "float"
    return Option(name, default, help, check, annotation, parse=float)


def _choice(name: str, default: str | None, help: str, choices: tuple, **more: Any) -> Option:
    """An option that takes one of `choices` (or None where it is the default)."""

    def check(value: Any) -> Any:
        if value is None and default is None:
            return None
        if value not in choices:
            extra = " (or None)" if default is None else ""
            raise ValueError(f"{name}={value!r} must be one of {', '.join(choices)}{extra}.")
        return value

    annotation = "str | None" if default is None else "str"
    return Option(name, default, help, check, annotation, **more, choices=choices)


def _switch(name: str, default: bool, help: str, **more: Any) -> Option:
    """A yes-or-no option."""
    return Option(name, default, help, bool, "bool", **{"parse": None, **more})


OPTIONS: dict[str, Option] = {
    option.name: option
    for option in (
        _count(
            "num_processes",
            None,
            "workers per machine (default: every GPU, every TPU core, or 2 CPU workers); "
            "with 1, the function runs in this process",
            minimum=1,
            positional=True,
        ),
        Option(
            "mixed_precision",
            "no",
            f"{', '.join(PRECISIONS)}; Accelerator() in the workers uses it unless told otherwise",
            normalize_precision,
            "str | None",
            positional=True,
            choices=PRECISIONS,
        ),
        Option(
            "use_port",
            None,
            "the rendezvous port (default: a free one; 29500 across machines)",
            _port,
            "int | str | None",
            positional=True,
            parse=int,
            aliases=("--master-port",),
        ),
        Option(
            "master_addr",
            "127.0.0.1",
            "address of machine 0",
            _address,
            "str",
            positional=True,
        ),
        _count("node_rank", 0, "this machine's number, from 0", minimum=0, positional=True),
        _count("num_nodes", 1, "machines taking part", minimum=1, positional=True),
        Option(
            "backend",
            None,
            f"{', '.join(_BACKENDS)}, or another torch.accelerator device type "
            "(default: what the hardware suggests)",
            _backend,
            "str | None",
        ),
        Option(
            "devices",
            None,
            "which GPUs, by index (default: the first num_processes); comma-separated "
            "on the command line",
            _devices,
            "list[int] | None",
            parse=_index_list,
        ),
        _count(
            "gradient_accumulation_steps",
            1,
            "optimizer steps every this many accumulate() blocks; Accelerator() picks it up",
            minimum=1,
        ),
        _count(
            "max_restarts", 0, "how many times to restart every worker after a failure", minimum=0
        ),
        _decimal(
            "timeout",
            None,
            "seconds for the whole run; then the workers are stopped and TimeoutError raised",
            "a positive number of seconds",
            optional=True,
        ),
        _decimal(
            "explain_hang_after",
            HANG_AFTER_SECONDS,
            "seconds without progress (no output, step or event) after which the cell shows "
            "where each rank is (its stack and collective); None: never",
            "a positive number of seconds, or None to never show where a stalled run's ranks are",
            optional=True,
        ),
        _switch(
            "post_mortem",
            False,
            "a worker whose function raises opens pdb on its frames, prompting in the cell "
            "(up/down, print, evaluate; c or q ends it); the other workers are stopped",
            saved=False,
        ),
        Option(
            "fsdp",
            None,
            "shard models with FSDP2 in prepare(): True, or FullyShardedDataParallelPlugin "
            "fields as a dict",
            _fsdp,
            "bool | dict | None",
            parse=None,
        ),
        _switch(
            "warm",
            True,
            "after a run, import in this process (in the background) the device-free "
            "modules the workers had to import themselves, so that the next launch's "
            "workers start with them; last_run().warming says what and what it cost",
            parse=_yes_no,
        ),
        _choice(
            "start_method",
            None,
            "how workers start: 'fork' (fastest; a forked worker cannot use a GPU the "
            "kernel already initialised), 'forkserver' (forked from a clean process "
            "started once: the first launch about 1.5-2 s slower, later ones about as fast "
            "as fork; works whatever the kernel did; the function and its arguments are "
            "pickled by value), 'spawn' (a fresh interpreter per worker: about 1.5 s slower "
            "every launch), or 'auto': fork unless the kernel can no longer, then "
            f"forkserver and say why (default: auto, or ${ENV_START_METHOD})",
            choices=START_METHODS,
        ),
        _switch(
            "return_all",
            False,
            "return every worker's value on this machine as a list ordered by rank",
            saved=False,
        ),
        _choice(
            "output",
            "all",
            f"{', '.join(OUTPUT_CHOICES)}: every rank's lines (others prefixed), the main "
            "rank's only, or none",
            choices=OUTPUT_CHOICES,
            parse=None,
            saved=False,
        ),
        _switch(
            "oversubscribe",
            False,
            "start CPU workers even beyond 8 per core, which is refused otherwise "
            "(more GPU or TPU workers than devices cannot run and is always refused)",
            parse=_yes_no,
        ),
        _choice(
            "cluster",
            "local",
            "where the workers run: 'local' (this machine's processes) or 'ray' (a Ray "
            "cluster: ray_address, or the kernel's Ray connection, or a new cluster of this "
            "machine alone)",
            choices=CLUSTERS,
        ),
        Option(
            "ray_address",
            None,
            "with cluster='ray': the cluster to connect to, 'auto', 'host:port' or "
            "'ray://host:port' (default: the kernel's Ray connection, $RAY_ADDRESS, or a new "
            "cluster of this machine alone)",
            _ray_address,
            "str | None",
        ),
        _choice(
            "placement_strategy",
            "PACK",
            f"with cluster='ray': how Ray places the workers, {', '.join(STRATEGIES)} (PACK "
            "fills nodes one after another, SPREAD spreads them)",
            choices=STRATEGIES,
        ),
        _count(
            "workers_per_node",
            None,
            "with cluster='ray': exactly this many workers on each node used (default: "
            "as placement_strategy places them)",
            minimum=1,
        ),
        _decimal(
            "cpus_per_worker",
            1.0,
            "with cluster='ray': CPUs Ray reserves for each worker",
            "a positive number of CPUs",
        ),
        _decimal(
            "keep_warm",
            120.0,
            "with cluster='ray': seconds the workers' processes stay up after a run, holding "
            "their GPUs or CPUs, so that the next launch starts at once (0: release at once; "
            "a stopped run always releases them; live workers keep them after close() only "
            "when it is given)",
            "a number of seconds, 0 or more",
            zero=True,
        ),
        _count(
            "threads_per_process",
            None,
            "torch threads in each worker (default 1; see 'Threads and fork' in "
            "docs/guides/launcher.md)",
            minimum=1,
            parse=None,
            saved=False,
        ),
    )
}

SAVED_OPTIONS = {name: option for name, option in OPTIONS.items() if option.saved}
# What only a launch on a Ray cluster (cluster="ray") reads.
CLUSTER_OPTIONS = (
    "ray_address",
    "placement_strategy",
    "workers_per_node",
    "cpus_per_worker",
    "keep_warm",
)
# What only a launch on this machine reads: on a Ray cluster, Ray places the workers.
LOCAL_OPTIONS = ("num_nodes", "node_rank", "master_addr", "use_port", "devices", "start_method")
POSITIONAL_OPTIONS = [name for name, option in OPTIONS.items() if option.positional]


def check_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option, checked and in canonical form: the given ones, the rest defaults.

    Unknown names are refused, suggesting the closest. Accelerate's rendezvous and
    monitoring options change nothing in a fork launcher (workers always meet at a static
    rendezvous the launching process hosts, and are watched continuously): a notebook
    that sets them away from Accelerate's defaults runs, told once per option.
    """
    for name, value in given.items():
        if name in OPTIONS or (name in ACCELERATE_ONLY and value == ACCELERATE_ONLY[name]):
            continue
        if name not in ACCELERATE_ONLY:
            close = difflib.get_close_matches(name, [*OPTIONS, *ACCELERATE_ONLY], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"notebook_launcher() got an unknown option {name!r}.{hint}")
        if name not in _warned_ignored:
            _warned_ignored.add(name)
            warnings.warn(
                f"notebook_launcher ignores {name}={value!r}: workers meet at a rendezvous "
                "hosted by the launching process and are watched continuously, so it changes "
                "nothing here.",
                UserWarning,
                stacklevel=2,
            )
    checked = {name: OPTIONS[name].check(value) for name, value in given.items() if name in OPTIONS}
    return {**{name: option.default for name, option in OPTIONS.items()}, **checked}


_warned_ignored: set[str] = set()


def check_options_fit_place(values: Mapping[str, Any]) -> None:
    """Refuse the options given for the other place a launch can run (this machine, or a
    Ray cluster with cluster='ray'): say so, rather than ignore them."""
    on_cluster = values["cluster"] == "ray"
    unread = LOCAL_OPTIONS if on_cluster else CLUSTER_OPTIONS
    given = [name for name in unread if values[name] != OPTIONS[name].default]
    if not given:
        return
    one = len(given) == 1
    if on_cluster:
        raise ValueError(
            f"{', '.join(given)} {'chooses' if one else 'choose'} machines, ports or devices "
            "by hand; with cluster='ray', Ray places the workers: leave "
            f"{'it' if one else 'them'} unset (num_processes, workers_per_node and "
            "placement_strategy say how many and where)."
        )
    raise ValueError(
        f"{', '.join(given)} {'is' if one else 'are'} for workers on a Ray cluster: pass "
        f"cluster='ray' too, or leave {'it' if one else 'them'} unset."
    )


def name_positionals(positional: tuple, given: dict[str, Any]) -> dict[str, Any]:
    """Options passed by position (Accelerate's order) joined to those passed by name."""
    if len(positional) > len(POSITIONAL_OPTIONS):
        raise TypeError(
            f"notebook_launcher() takes at most {len(POSITIONAL_OPTIONS) + 2} positional "
            f"arguments (function, args, {', '.join(POSITIONAL_OPTIONS)}); pass the rest "
            "by name."
        )
    named = dict(given)
    for name, value in zip(POSITIONAL_OPTIONS, positional, strict=False):
        if name in named:
            raise TypeError(f"notebook_launcher() got option {name!r} twice.")
        named[name] = value
    return named


# -- the launch file ------------------------------------------------------------------------


class ConfigError(ValueError):
    """A launch configuration file with an unknown key or a bad value."""


def _saved_option_fields(cls: type) -> type:
    """Give `cls` one dataclass field per saved option, with the option's default."""
    cls.__annotations__ = {name: option.annotation for name, option in SAVED_OPTIONS.items()}
    for name, option in SAVED_OPTIONS.items():
        setattr(cls, name, option.default)  # every default is None or immutable
    return dataclass(cls)


@_saved_option_fields
class LaunchConfig:
    """The choices of a launch, as the panel, the YAML file and the command line hold them.

    One field per `notebook_launcher` option that a file can hold (see
    `notebook_accel.launch.options.OPTIONS`), with the same name and default.
    """

    def launch_options(self) -> dict:
        """The keyword arguments for `notebook_launcher`."""
        return dataclasses.asdict(self)

    def checked(self) -> LaunchConfig:
        """This configuration with every value checked and canonical (raises ValueError)."""
        return LaunchConfig(**{name: OPTIONS[name].check(v) for name, v in vars(self).items()})

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
        """Read YAML text; an error names `source`, the line and the option."""
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
            key, line = key_node.value, key_node.start_mark.line
            if key not in SAVED_OPTIONS:
                close = difflib.get_close_matches(key, list(SAVED_OPTIONS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{source}, line {line + 1}: unknown key {key!r}{hint}")
            try:
                values[key] = SAVED_OPTIONS[key].check(yaml.safe_load(yaml.serialize(value_node)))
            except (TypeError, ValueError) as error:
                line = _line_of_bad_field(value_node) or line
                raise ConfigError(f"{source}, line {line + 1}: {error}") from None
        return cls(**values)


def _line_of_bad_field(node: Any) -> int | None:
    """For the `fsdp:` section, the line of its first bad field."""
    import yaml

    for field_node, value_node in node.value if isinstance(node, yaml.MappingNode) else ():
        try:
            normalize_fsdp({field_node.value: yaml.safe_load(yaml.serialize(value_node))})
        except ValueError:
            return field_node.start_mark.line
    return None
