"""Run a command on a busy machine: CPU-bound processes and another Ray cluster beside it.

    python bench/busy_machine.py -- make test
    python bench/busy_machine.py --busy 2 --no-ray -- python -m pytest tests/launch

What a user's laptop or a shared CI runner looks like to the test suite: `--busy`
processes that each keep a core busy for the whole run, and (unless `--no-ray`) a
Ray cluster of its own started first on Ray's default ports (`ray start --head
--port=6379 --dashboard-port=8265`, kept on the loopback interface). Once the
command ends, the load is stopped (by the PIDs it started, never by name) and every
process of the command's that still runs is listed (new since it started, with the
mark the command's environment passes on to all it starts): a suite that cleans up
after itself leaves none. The exit status is the command's, or 3 if it
left processes behind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil

from notebook_accel.launch.processes import OtherProcess, end_processes

# Keeps a Ray cluster on 127.0.0.1, as Ray does on macOS and Windows.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SPIN = "while True: pass"
# Set in the command's environment: what it started, and what those started, carry it.
RUN_TOKEN = "BUSY_MACHINE_RUN"


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def start_ray(temp_dir: str) -> None:
    """A Ray head of one CPU on Ray's default ports, its files under `temp_dir`."""
    command = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
        "--port=6379", "--dashboard-port=8265", "--num-cpus=1", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    subprocess.run(
        command, env={**os.environ, **LOOPBACK}, check=True, timeout=120, capture_output=True
    )


def ray_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes whose command line names `temp_dir`: with the cluster's directory,
    that cluster's processes, no other's."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in process.info["cmdline"] or ()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def left_behind(before: set[int], load: set[int], token: str) -> list[str]:
    """Processes of the command's that still run: new since it started, not the load's,
    and carrying `token` in their environment, which the command's descendants inherit
    (orphans too). Whatever else started meanwhile on the machine (another user's
    shell) is none of the command's."""
    time.sleep(2)  # what the command stopped as it ended gets a moment to go
    found = []
    for process in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        info = process.info
        if info["pid"] in before or info["pid"] in load or info["pid"] == os.getpid():
            continue
        if info["status"] == psutil.STATUS_ZOMBIE or not info["cmdline"]:
            continue  # a zombie, or a kernel thread (no command line)
        if not _carries(process, token):
            continue
        found.append(f"{info['pid']} {' '.join(info['cmdline'] or [info['name'] or '?'])[:160]}")
    return found


def _carries(process: psutil.Process, token: str) -> bool:
    try:
        return process.environ().get(RUN_TOKEN) == token
    except psutil.Error:
        return False


def end_by_pid(pids: set[int]) -> None:
    """SIGTERM to each of `pids` still running, SIGKILL to those left after 10 s."""
    end_processes(OtherProcess.of(pids), grace=10, reap=10, groups=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside it")
    parser.add_argument("--no-ray", action="store_true", help="no other Ray cluster")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    options = parser.parse_args()
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("name the command to run after --")
    temp_dir = tempfile.mkdtemp(prefix="busy-ray-", dir="/tmp")  # short: Ray's socket paths
    busy = start_busy(options.busy)
    load = {process.pid for process in busy}
    cluster: set[int] = set()
    try:
        if not options.no_ray:
            # What `ray start` leaves running: its processes new since just before it (its
            # Ray Client server names neither the directory nor the session), and any
            # whose command line names the cluster's directory.
            before_ray = set(psutil.pids())
            start_ray(temp_dir)
            cluster = {p.pid for p in ray_processes("ray") if p.pid not in before_ray}
            cluster |= {process.pid for process in ray_processes(temp_dir)}
            load |= cluster
            print(f"another Ray cluster runs on 6379/8265 ({len(cluster)} processes)")
        print(f"{options.busy} busy processes; running: {' '.join(command)}", flush=True)
        before = {process.pid for process in psutil.process_iter()}
        started = time.monotonic()
        token = f"{os.getpid()}-{time.time_ns()}"
        status = subprocess.call(command, env={**os.environ, RUN_TOKEN: token})
        took = time.monotonic() - started
    finally:
        end_by_pid({p.pid for p in busy})
        if not options.no_ray:
            cluster |= {p.pid for p in ray_processes(temp_dir)}
            end_by_pid(cluster)
    leftover = left_behind(before, load, token)
    print(f"the command ended with {status} after {took:.0f} s")
    if leftover:
        print("processes it left running:\n  " + "\n  ".join(leftover))
        return status or 3
    print("it left no process running")
    return status


if __name__ == "__main__":
    sys.exit(main())
