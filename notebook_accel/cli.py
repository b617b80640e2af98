"""The `notebook-accel` command: env, config, launch, test and demo.

notebook-accel env                       versions, hardware, settings for bug reports
notebook-accel config --mixed-precision bf16 --num-processes 4
notebook-accel config --check launch.yaml
notebook-accel launch --config launch.yaml train.py --epochs 3
notebook-accel test                      a short distributed self-check
notebook-accel demo                      train a small model on synthetic data
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from notebook_accel import demo
from notebook_accel.launch.options import OPTIONS, SAVED_OPTIONS, LaunchConfig, Option

DEFAULT_CONFIG = "launch.yaml"
# Variables worth seeing in a bug report.
ENV_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "PJRT_",
    "XLA_",
    "TPU_",
    "MASTER_",
    "PYTORCH_",
    "NOTEBOOK_ACCEL_",
    "TORCHELASTIC_",
)
ENV_NAMES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "COLAB_RELEASE_TAG",
    "KAGGLE_KERNEL_RUN_TYPE",
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        return options.handler(options)
    except (ValueError, OSError) as error:
        print(f"notebook-accel {options.command}: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="notebook-accel",
        description="Train PyTorch models on every device of this machine, or of several.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    env = commands.add_parser("env", help="versions, hardware and settings, for bug reports")
    env.set_defaults(handler=run_env)

    config = commands.add_parser("config", help="write or check a launch configuration file")
    config.add_argument(
        "--file", default=DEFAULT_CONFIG, help="the YAML file (default: %(default)s)"
    )
    config.add_argument("--check", metavar="FILE", help="only check FILE and print it")
    for option in SAVED_OPTIONS.values():
        if option.parse is not None:
            _add_option_flag(config, option)
    fsdp = config.add_argument_group("sharding (FSDP2); any --fsdp-* option turns it on")
    fsdp.add_argument("--fsdp", action=argparse.BooleanOptionalAction, help="shard models")
    fsdp.add_argument("--fsdp-wrap-classes", metavar="A,B", help="module classes to shard apart")
    fsdp.add_argument("--fsdp-min-num-params", type=int, help="shard apart modules this big")
    fsdp.add_argument("--fsdp-reshard-after-forward", action=argparse.BooleanOptionalAction)
    fsdp.add_argument("--fsdp-cpu-offload", action=argparse.BooleanOptionalAction)
    fsdp.add_argument("--fsdp-state-dict-type", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    config.set_defaults(handler=run_config)

    launch = commands.add_parser(
        "launch",
        help="run a script on this machine's devices (or a cluster) via torchrun",
    )
    launch.add_argument("--config", help="launch configuration file (see `config`)")
    for name in ("num_processes", "mixed_precision", "node_rank"):
        _add_option_flag(launch, OPTIONS[name], "overrides the file's value")
    launch.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    launch.add_argument("script", help="the training script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    launch.set_defaults(handler=run_launch)

    check = commands.add_parser("test", help="a short distributed self-check on this hardware")
    check.add_argument("--processes", type=int, default=None)
    check.add_argument("--cpu", action="store_true", help="use CPU workers even with GPUs")
    check.set_defaults(handler=run_self_check)

    demo_parser = commands.add_parser(
        "demo", help="train a small model on synthetic data", description=demo.__doc__
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.run)
    return parser


def _add_option_flag(parser: argparse.ArgumentParser, option: Option, note: str = "") -> None:
    """A flag for one launch option, its help and choices taken from the option."""
    help_text = option.help.replace("%", "%%") + (f"; {note}" if note else "")
    parser.add_argument(
        option.flag,
        *option.aliases,
        dest=option.name,
        type=option.parse,
        choices=option.choices,
        help=help_text,
    )


# -- env -------------------------------------------------------------------------


def run_env(options: argparse.Namespace) -> int:
    print(environment_report())
    return 0


def tested_range_line() -> str:
    """The tested range, and what of this machine is outside it (the private torch APIs
    this torch lacks included)."""
    from notebook_accel import internals
    from notebook_accel.internals import tested_range

    line = f"{tested_range.tested_range()}, Python {', '.join(tested_range.TESTED_PYTHON)}"
    problems = [tested_range.untested()] if tested_range.untested() else []
    lacking = [api.name for api in internals.missing()]
    if lacking:
        problems.append(f"this torch lacks {', '.join(lacking)} (see notebook_accel.internals)")
    return line + "".join(f"\n  UNTESTED        {problem}" for problem in problems)


def environment_report() -> str:
    import platform
    from importlib import metadata

    from notebook_accel.platforms.registry import detect_hardware as detect
    from notebook_accel.views import format as fmt

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    import torch

    lines = ["Versions"]
    lines.append(f"  Python          {platform.python_version()} ({platform.platform()})")
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
    lines.append(f"  torch           {torch.__version__}{cuda}")
    lines.append(f"  tested on       {tested_range_line()}")
    for package in (
        "torch_xla",
        "notebook-accel",
        "ipykernel",
        "ipywidgets",
        "jupyterlab",
        "accelerate",
        "torchao",
        "ray",
    ):
        lines.append(f"  {package:<15} {version(package)}")
    hardware = detect()
    lines += [
        "Hardware",
        f"  accelerator     {hardware.accelerator}",
        f"  CPU cores       {hardware.cpu_cores}",
        f"  memory          {fmt.size(hardware.ram_bytes)}",
    ]
    for gpu in hardware.gpus:
        capability = f" compute {gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else ""
        lines.append(f"  GPU {gpu.index:<11} {gpu.name}, {fmt.size(gpu.memory_bytes)}{capability}")
    if hardware.tpu_cores:
        lines.append(f"  TPU cores       {hardware.tpu_cores}")
    found = hardware.accelerators
    if found is not None and found.problem:
        lines.append(f"  {found.device_type:<15} cannot be used: {found.problem}")
    elif found is not None:
        name = f" ({found.name})" if found.name else ""
        precisions = ", ".join(found.precisions) or "none"
        lines.append(
            f"  {found.device_type:<15} {found.count} device(s){name}; autocast: {precisions}"
        )
    relevant = sorted(
        name for name in os.environ if name.startswith(ENV_PREFIXES) or name in ENV_NAMES
    )
    lines.append("Environment")
    lines += [f"  {name}={os.environ[name]}" for name in relevant] or ["  (none set)"]
    lines += _cuda_started_report()
    return "\n".join(lines)


def _cuda_started_report() -> list[str]:
    """Which running kernels started CUDA, and where: their launches fork from a clean process."""
    from notebook_accel.platforms import cuda_origin

    records = cuda_origin.kernel_origins()
    if not records:
        return ["CUDA started in running processes", "  none"]
    return [
        "CUDA started in running processes (their launches fork workers from a clean process)",
        *(f"  pid {r['pid']} ({r['command']}): {r['origin']}" for r in records),
    ]


# -- config ----------------------------------------------------------------------


def run_config(options: argparse.Namespace) -> int:
    if options.check:
        config = LaunchConfig.load(options.check)
        print(config.to_yaml(), end="")
        print(f"{options.check}: valid")
        return 0
    config = LaunchConfig.load(options.file) if os.path.exists(options.file) else LaunchConfig()
    for name, option in SAVED_OPTIONS.items():
        value = getattr(options, name, None)
        if option.parse is not None and value is not None:
            setattr(config, name, value)
    config.fsdp = fsdp_choice(options, config.fsdp)
    # The same checks, and messages, as a file's and notebook_launcher's.
    config = config.checked()
    config.save(options.file)
    print(config.to_yaml(), end="")
    print(f"written to {options.file}")
    return 0


def fsdp_choice(options: argparse.Namespace, current: dict | None) -> dict | None:
    """The `fsdp` section after the --fsdp options (merged into the file's section)."""
    from notebook_accel.config.settings import normalize_fsdp

    if options.fsdp is False:
        return None
    changes = {
        "transformer_cls_names_to_wrap": options.fsdp_wrap_classes,
        "min_num_params": options.fsdp_min_num_params,
        "reshard_after_forward": options.fsdp_reshard_after_forward,
        "cpu_offload": options.fsdp_cpu_offload,
        "state_dict_type": options.fsdp_state_dict_type,
    }
    changes = {key: value for key, value in changes.items() if value is not None}
    if not options.fsdp and not changes:
        return current
    return normalize_fsdp({**(current or {}), **changes})


# -- launch ----------------------------------------------------------------------


def run_launch(options: argparse.Namespace) -> int:
    command, env = torchrun_command(options)
    if options.dry_run:
        settings = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("NOTEBOOK"))
        print(settings, " ".join(command))
        return 0
    completed = subprocess.run(command, env={**os.environ, **env}, check=False)
    return completed.returncode


def torchrun_command(options: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The torch.distributed.run command line and the settings for the workers."""
    from notebook_accel.config.settings import LaunchSettings
    from notebook_accel.launch.preflight import DEFAULT_MULTINODE_PORT, choose_workers
    from notebook_accel.platforms.registry import detect_hardware

    config = LaunchConfig.load(options.config) if options.config else LaunchConfig()
    if not os.path.exists(options.script):
        raise ValueError(f"no script at {options.script!r}")
    overrides = {
        name: getattr(options, name)
        for name in ("num_processes", "mixed_precision", "node_rank")
        if getattr(options, name) is not None
    }
    values = {**config.launch_options(), **overrides}
    values = LaunchConfig(**values).checked().launch_options()
    if values["cluster"] != "local":
        raise ValueError(
            f"the configuration says cluster={values['cluster']!r}, but `notebook-accel "
            "launch` runs a script with torchrun on this machine (and the machines you start "
            "it on). Run the function from a notebook with notebook_launcher(..., "
            "config=...), or submit the script to the Ray cluster with `ray job submit`."
        )
    hardware = detect_hardware()
    # The launcher's own checks: platform, worker count, precision.
    platform, processes = choose_workers(values, hardware)
    platform.check_precision(values["mixed_precision"], hardware)
    precision = values["mixed_precision"]
    node_rank = values["node_rank"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={processes}",
        f"--nnodes={config.num_nodes}",
    ]
    if config.num_nodes == 1 and config.use_port is None:
        command.append("--standalone")
    else:
        port = config.use_port or DEFAULT_MULTINODE_PORT
        command += [
            f"--node-rank={node_rank}",
            f"--master-addr={config.master_addr}",
            f"--master-port={port}",
        ]
    if config.max_restarts:
        command.append(f"--max-restarts={config.max_restarts}")
    command += [options.script, *options.script_args]
    env = LaunchSettings(
        platform.name, precision, config.gradient_accumulation_steps, fsdp=config.fsdp
    ).to_env()
    env.update(platform.worker_environment(0, config.devices))  # the chosen GPUs, say
    return command, env


# -- test ------------------------------------------------------------------------


def self_check() -> dict[str, Any]:
    """Exercise the collectives and one DDP step; runs in every worker."""
    import torch

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    checks = {}
    total = accelerator.reduce(torch.tensor([float(rank)], device=accelerator.device))
    checks["reduce"] = total.item() == sum(range(world))
    gathered = accelerator.gather(torch.tensor([rank], device=accelerator.device))
    checks["gather"] = gathered.tolist() == list(range(world))
    samples = world * 3 + 1  # uneven on purpose
    loader = torch.utils.data.DataLoader(torch.arange(samples), batch_size=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = torch.cat([accelerator.gather_for_metrics(batch) for batch in loader])
    checks["gather_for_metrics"] = sorted(seen.tolist()) == list(range(samples))
    inputs = torch.full((2, 4), float(rank + 1), device=accelerator.device)
    accelerator.backward(model(inputs).sum())
    optimizer.step()
    weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().flatten())
    checks["ddp_step"] = bool(torch.allclose(weights.view(world, -1), weights.view(world, -1)[0]))
    return {
        "world_size": world,
        "device": str(accelerator.device),
        "backend": accelerator.distributed_type.value
        if hasattr(accelerator.distributed_type, "value")
        else str(accelerator.distributed_type),
        "checks": checks,
    }


def run_self_check(options: argparse.Namespace) -> int:
    from notebook_accel import WorkerError
    from notebook_accel.launch.preflight import plan_launch
    from notebook_accel.launch.running import run_plan
    from notebook_accel.reporting.observers import ConsoleObserver

    # Even one process is forked, as the panel does: forking is what is checked
    # (and a timeout needs a worker to stop).
    plan = plan_launch(
        function=self_check,
        num_processes=options.processes,
        backend="cpu" if options.cpu else None,
        timeout=120,
        single_in_process=False,
    )
    try:
        report = run_plan(plan, ConsoleObserver())
    except (WorkerError, TimeoutError) as error:
        print(f"FAILED: {error}")
        return 1
    print(f"{report['world_size']} worker(s) on {report['device']} ({report['backend']})")
    for name, passed in report["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    passed = all(report["checks"].values())
    print("self-check passed" if passed else "self-check FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
