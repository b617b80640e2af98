"""A detached run on the Ray cluster, from real Jupyter kernels: its keeper is a detached
actor, so the kernel that launched it (the Ray driver) can die mid-run; a new kernel
attaches and gets the output and the result, and its stop frees every actor and placement
group. A keeper that dies takes the run's agents and workers along."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray
from jupyter_client.manager import start_new_kernel

from cluster_support import wait_until_nothing_is_left
from notebook_accel.launch.runs.on_cluster import find_cluster_run
from tests_support import PROMPTLY, run_in_kernel

SETUP = """
import time, torch
ADDRESS = RAY_ADDRESS
from notebook_accel import Accelerator, attach, notebook_launcher, runs
ON_CLUSTER = dict(cluster="ray", ray_address=ADDRESS, num_processes=2, cpus_per_worker=0.5,
                  placement_strategy="STRICT_SPREAD", detach=True)

def count(steps):
    accelerator = Accelerator()
    total = 0.0
    for step in range(steps):
        total += accelerator.reduce(torch.ones(1) * (step + 1)).item()
        print(f"step {step}", flush=True)
        time.sleep(0.3)
    return total

def forever():
    accelerator = Accelerator()
    step = 0
    while True:
        accelerator.reduce(torch.ones(1))
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.1)
"""


@pytest.fixture
def kernels():
    started = []

    def start():
        manager, client = start_new_kernel(kernel_name="python3")
        started.append((manager, client))
        return manager, client

    yield start
    for manager, client in started:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def wait_for_line(run_id: str, line: str) -> None:
    run = find_cluster_run(run_id)
    deadline = time.monotonic() + PROMPTLY
    while line not in run.output():
        assert time.monotonic() < deadline, f"run {run_id} did not print {line!r}"
        time.sleep(0.2)


def test_a_killed_driver_s_run_goes_on_and_a_new_kernel_gets_it_and_stops_the_other(
    ray_cluster, kernels
):
    setup = SETUP.replace("RAY_ADDRESS", repr(ray_cluster.address))
    manager, client = kernels()
    started = run_in_kernel(
        client,
        setup + "finite = notebook_launcher(count, (12,), **ON_CLUSTER)\n"
        "endless = notebook_launcher(forever, **ON_CLUSTER)\n"
        "print('ids', finite.id, endless.id)",
        timeout=PROMPTLY,
    )
    assert started["reply"]["status"] == "ok", started["text"]
    finite_id, endless_id = started["text"].split("ids ")[1].split()
    wait_for_line(finite_id, "[rank 1] step 2")
    wait_for_line(endless_id, "[rank 1] step 1")
    driver = manager.provisioner.process.pid
    os.kill(driver, signal.SIGKILL)  # the kernel, the Ray driver that launched both
    psutil.Process(driver).wait(PROMPTLY)

    _, client = kernels()
    attached = run_in_kernel(
        client,
        setup + "print(runs(ray_address=ADDRESS))\n"
        f"print('result', attach({finite_id!r}, ray_address=ADDRESS))",
        timeout=PROMPTLY,
    )
    assert attached["reply"]["status"] == "ok", attached["text"]
    assert f"{endless_id}  running" in attached["text"]
    assert "result 156.0" in attached["text"]  # 2 workers x (1 + ... + 12)
    shown = [line for line in attached["text"].splitlines() if line.startswith("[rank 1] step")]
    assert shown == [f"[rank 1] step {step}" for step in range(12)]

    stopped = run_in_kernel(
        client,
        f"endless = attach({endless_id!r}, wait=False, live=False)\n"
        f"endless.stop()\nprint('now', endless.state)\n"
        f"attach({finite_id!r}, wait=False, live=False).forget()",
        timeout=PROMPTLY,
    )
    assert "now stopped" in stopped["text"], stopped["text"]
    assert wait_until_nothing_is_left(ray_cluster) == []

    # A keeper that dies takes its agents and workers along; the run shows as lost.
    started = run_in_kernel(
        client,
        "doomed = notebook_launcher(forever, **ON_CLUSTER)\nprint('ids', doomed.id)",
        timeout=PROMPTLY,
    )
    (doomed_id,) = started["text"].split("ids ")[1].split()
    wait_for_line(doomed_id, "[rank 1] step 1")
    ray.kill(find_cluster_run(doomed_id)._actor, no_restart=True)
    lost = run_in_kernel(client, "doomed.result()", timeout=PROMPTLY)
    assert lost["reply"].get("ename") == "RunLostError", lost["text"]
    assert wait_until_nothing_is_left(ray_cluster) == []
