"""Where a command's CPU goes, by kind of process.

    python bench/suite_cpu.py -- make test
    python bench/suite_cpu.py --every 0.2 -- python -m pytest tests/launch/cluster

The test suite is CPU-bound on 2 cores, so its time is the CPU its processes use: Ray's
agents and nodes, Jupyter kernels, workers in fresh interpreters, the templates they are
forked from, pytest's own processes. While the command runs, every `--every` seconds each
of its processes (those carrying a mark the command's environment passes on to all it
starts, orphans and processes of their own session included) is read once more: its
command line (a Ray worker retitles itself once it holds an actor) and its CPU time so
far. Once the command ends, the CPU-seconds of each kind are printed, with the share of
the machine's CPU time that the samples account for: a process that lives less than one
interval is missed. A process forked from another (same command line) counts under its
parent's kind, "forked". The exit status is the command's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import psutil

# Set in the command's environment: what it started, and what those started, carry it.
RUN_TOKEN = "SUITE_CPU_RUN"

# Kinds of process, the first pattern found in the command line deciding.
KINDS = [
    (r"^ray::NodeAgent", "Ray: launch agents"),
    (r"^ray::ClusterKeeper", "Ray: detached-run keepers"),
    (r"^ray::IDLE|default_worker\.py|setup_worker\.py", "Ray: idle workers"),
    (r"^ray::", "Ray: other actors and tasks"),
    (
        r"raylet|gcs_server|ray/dashboard|ray-dashboard|log_monitor|autoscaler|ray\.util\.client|"
        r"ray_client_server|runtime_env",
        "Ray: cluster processes",
    ),
    (r"ipykernel", "Jupyter kernels"),
    (r"launch\.fresh import run_shipped", "workers in fresh interpreters"),
    (r"template_server import template_main", "templates (start method forkserver)"),
    (r"processes import _detach", "keepers of detached runs"),
    # pytest-xdist's test processes start through execnet's bootstrap.
    (r"-u -c import sys;exec\(eval\(sys\.stdin", "pytest's test processes"),
    (r"-m pytest\b|bin/pytest\b", "pytest"),
    (r"jupyter-lab|jupyter_server", "JupyterLab servers"),
    (r"chrom|playwright", "browser"),
    (r"mkdocs", "mkdocs"),
    (r"-m pip\b|/pip\b", "pip"),
    (r"notebook_accel\.cli|notebook-accel", "the notebook-accel command"),
    (r"torch\.distributed\.run|torchrun", "torchrun"),
]


@dataclass
class Seen:
    """One process of the command's, as last read."""

    pid: int
    parent: tuple[int, float] | None
    command: str
    cpu: float


def kind_of(command: str) -> str:
    for pattern, kind in KINDS:
        if re.search(pattern, command):
            return kind
    words = command.split()
    return "other: " + (" ".join([os.path.basename(words[0]), *words[1:2]]) if words else "?")


def _carries(process: psutil.Process, token: str) -> bool:
    try:
        return process.environ().get(RUN_TOKEN) == token
    except psutil.Error:
        return False


def sample(seen: dict[tuple[int, float], Seen], ignored: set, token: str) -> None:
    """Read every process once: the command's are updated in `seen`, others go to
    `ignored` (their environment is read once)."""
    attrs = ["pid", "ppid", "create_time", "cmdline", "cpu_times"]
    for process in psutil.process_iter(attrs):
        info = process.info
        key = (info["pid"], info["create_time"])
        if key in ignored or info["cpu_times"] is None:
            continue
        if key not in seen and not _carries(process, token):
            ignored.add(key)
            continue
        command = " ".join(info["cmdline"] or [])
        cpu = info["cpu_times"].user + info["cpu_times"].system
        parent = None
        if key in seen:
            parent, command = seen[key].parent, command or seen[key].command
        else:
            try:
                parent = (info["ppid"], psutil.Process(info["ppid"]).create_time())
            except psutil.Error:
                pass
        seen[key] = Seen(info["pid"], parent, command, cpu)


def by_kind(seen: dict[tuple[int, float], Seen]) -> tuple[Counter, Counter]:
    """CPU-seconds and processes of each kind; a fork of a process of the command (its
    command line unchanged) counts as its parent's kind, forked."""
    cpu: Counter = Counter()
    count: Counter = Counter()
    for each in seen.values():
        kind = kind_of(each.command)
        parent = seen.get(each.parent) if each.parent else None
        if parent is not None and parent.command == each.command:
            kind += ", forked"
        cpu[kind] += each.cpu
        count[kind] += 1
    return cpu, count


def machine_cpu() -> float:
    times = psutil.cpu_times()
    return times.user + times.nice + times.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    options = parser.parse_args()
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("name the command to run after --")
    token = f"{os.getpid()}-{time.time_ns()}"
    seen: dict[tuple[int, float], Seen] = {}
    ignored: set = set()
    machine_before, started = machine_cpu(), time.monotonic()
    process = subprocess.Popen(command, env={**os.environ, RUN_TOKEN: token})
    try:
        while process.poll() is None:
            sample(seen, ignored, token)
            time.sleep(options.every)
    finally:
        status = process.wait()
    sample(seen, ignored, token)  # what still runs (a leftover) has its last word
    machine = machine_cpu() - machine_before
    cpu, count = by_kind(seen)
    total = sum(cpu.values())
    took, share = time.monotonic() - started, 100 * total / max(machine, 0.01)
    print(
        f"\n{total:.0f} CPU-seconds in {len(seen)} processes of the command, in {took:.0f} s;"
        f" the machine used {machine:.0f} (the samples saw {share:.0f}% of it)"
    )
    print(f"{'CPU-s':>8} {'procs':>6}  kind")
    for kind, seconds in cpu.most_common():
        print(f"{seconds:8.1f} {count[kind]:6d}  {kind}")
    return status


if __name__ == "__main__":
    sys.exit(main())
