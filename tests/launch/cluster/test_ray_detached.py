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

class StepCounter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

def resumable(project, steps, hold_at=None):
    from notebook_accel import ProjectConfiguration, resume_checkpoint
    accelerator = Accelerator(
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    if resume_checkpoint():
        accelerator.load_state(resume_checkpoint())
    for step in range(counter.step, steps):
        batch = torch.Generator().manual_seed(100 * step + accelerator.process_index)
        loss = model(torch.randn(8, 4, generator=batch)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        counter.step = step + 1
        if counter.step % 3 == 0:
            accelerator.save_state()
        if counter.step == hold_at:
            print("holding", flush=True)
            time.sleep(600)
    return accelerator.unwrap_model(model).weight.detach().clone()

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


# Cells that wait for whole runs on the cluster to end (attach(), result(), a resume and
# its reference run) get a hang guard that fits that work: beside a full suite on 2 cores
# the resumed run and its reference took over PROMPTLY. The tests' own limit grows to match.
WHOLE_RUNS = 3 * PROMPTLY
pytestmark = pytest.mark.timeout(480)


def wait_for_line(run_id: str, line: str) -> None:
    run = find_cluster_run(run_id)
    deadline = time.monotonic() + PROMPTLY
    while line not in run.output():
        assert time.monotonic() < deadline, f"run {run_id} did not print {line!r}"
        time.sleep(0.2)


def test_a_killed_driver_s_run_goes_on_and_a_new_kernel_gets_it_and_stops_the_other(
    ray_cluster, kernels, tmp_path
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
        timeout=WHOLE_RUNS,
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


# Its own test: with the killed driver's scenario, under load, the two outran one time limit.
def test_a_killed_keeper_takes_its_agents_and_the_run_resumes_from_its_checkpoint(
    ray_cluster, kernels, tmp_path
):
    """A keeper that dies takes its agents and workers along; the kernel that holds the
    run gets RunLostError, and resumes it from its newest checkpoint to the weights of a
    run never interrupted."""
    _, client = kernels()
    setup = SETUP.replace("RAY_ADDRESS", repr(ray_cluster.address))
    assert run_in_kernel(client, setup, timeout=PROMPTLY)["reply"]["status"] == "ok"
    started = run_in_kernel(
        client,
        f"doomed = notebook_launcher(resumable, ({str(tmp_path / 'doomed')!r}, 9, 6),"
        " **ON_CLUSTER)\nprint('ids', doomed.id)",
        timeout=PROMPTLY,
    )
    (doomed_id,) = started["text"].split("ids ")[1].split()
    wait_for_line(doomed_id, "[rank 1] holding")
    # What a keeper held goes with it: the kernel keeps the newest checkpoint it heard of.
    heard = run_in_kernel(
        client,
        "deadline = time.monotonic() + 60\n"
        "while not doomed.poll() and not str(doomed.report.checkpoint).endswith('_1')"
        " and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
        "print('heard of', doomed.report.checkpoint)",
        timeout=PROMPTLY,
    )
    assert "checkpoint_1" in heard["text"], heard["text"]
    ray.kill(find_cluster_run(doomed_id)._actor, no_restart=True)
    lost = run_in_kernel(
        client,
        "try:\n    doomed.result()\nexcept Exception as error:\n    lost = error\n"
        "print(type(lost).__name__, lost.checkpoint)",
        timeout=WHOLE_RUNS,
    )
    assert "RunLostError" in lost["text"] and "checkpoint_1" in lost["text"], lost["text"]
    assert wait_until_nothing_is_left(ray_cluster) == []
    resumed = run_in_kernel(
        client,
        "resumed = doomed.resume()\nweights = resumed.result()\n"
        # Never interrupted: two CPU workers forked from this kernel, which is a driver of
        # the cluster. A run on the cluster trains exactly as local workers do
        # (test_ray_launch.py); this one starts no agents.
        f"reference = notebook_launcher(resumable, ({str(tmp_path / 'reference')!r}, 9),"
        " num_processes=2, backend='cpu')\n"
        "print('bit for bit:', torch.equal(weights, reference))\n"
        "resumed.forget()",
        timeout=WHOLE_RUNS,
    )
    assert "bit for bit: True" in resumed["text"], resumed["text"]
    assert wait_until_nothing_is_left(ray_cluster) == []
