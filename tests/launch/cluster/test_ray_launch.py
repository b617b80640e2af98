"""notebook_launcher on a real Ray cluster of two nodes: the same run, result and errors as on
one machine, output and metrics back in the kernel, stops that free everything, warm relaunches."""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import time

import psutil
import pytest
import ray
import torch

from cluster_support import wait_until_nothing_is_left
from notebook_accel import PlacementError, WorkerError, last_run, notebook_launcher
from notebook_accel.reporting.events import OutputLine
from notebook_accel.reporting.observers import RunObserver
from tests_support import PROMPTLY

ON_TWO_NODES = {"num_processes": 2, "cluster": "ray", "placement_strategy": "STRICT_SPREAD"}


def train(epochs: int):
    """A small model with dropout, a shuffled loader, SGD: what a notebook trains."""
    from notebook_accel import Accelerator, set_seed

    set_seed(0)
    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for epoch in range(epochs):
        for step, (inputs, targets) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            accelerator.log({"loss": loss.item()}, step=epoch * len(loader) + step)
        print(f"epoch {epoch} on rank {accelerator.process_index}")
    return {
        "weights": accelerator.unwrap_model(model).state_dict(),
        "losses": losses,
        "disk": os.environ.get("NODE_DISK"),
        "precision": accelerator.mixed_precision,
        "agent": os.getppid(),
        "niceness": os.nice(0),
    }


def test_two_nodes_train_exactly_as_two_local_workers(ray_cluster):
    on_cluster = notebook_launcher(train, (2,), return_all=True, live=False, **ON_TWO_NODES)
    local = notebook_launcher(train, (2,), num_processes=2, return_all=True, live=False)
    assert {value["disk"] for value in on_cluster} == {str(d) for d in ray_cluster.disks.values()}
    # At the kernel's priority, as the local workers: not at Ray's niceness of 15 for its
    # worker processes, which beside other work on the node starves a run.
    assert [value["niceness"] for value in on_cluster] == [os.nice(0)] * 2
    for remote, here in zip(on_cluster, local, strict=True):
        assert remote["losses"] == here["losses"]
        for name, tensor in here["weights"].items():
            assert torch.equal(remote["weights"][name], tensor), name
    report = last_run()  # of the local run; the cluster's came first
    assert report.world_size == 2


class Lines(RunObserver):
    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []

    def on_event(self, event, report) -> None:
        if isinstance(event, OutputLine):
            self.lines.append((event.rank, event.line))


def chatty(count: int):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    for index in range(count):
        print(f"line {index} of rank {accelerator.process_index}", flush=index % 7 == 0)
        accelerator.log({"index": float(index)}, step=index)
    return accelerator.process_index * 10


def test_output_metrics_and_every_rank_s_value_come_back(ray_cluster, capsys):
    lines = Lines()
    values = notebook_launcher(chatty, (50,), return_all=True, observers=[lines], **ON_TWO_NODES)
    assert values == [0, 10]
    for rank in (0, 1):
        assert [line for r, line in lines.lines if r == rank] == [
            f"line {index} of rank {rank}\n" for index in range(50)
        ]
    printed = capsys.readouterr().out
    assert "[rank 1] line 49 of rank 1\n" in printed
    assert "line 0 of rank 0\n" in printed
    assert "pid=" not in printed and "NodeAgent" not in printed  # no prefixes of Ray's
    report = last_run()
    assert report.status == "finished"
    assert [record.values["index"] for record in report.metrics] == [float(i) for i in range(50)]
    assert notebook_launcher(chatty, (1,), live=False, **ON_TWO_NODES) == 0  # rank 0's only


def fails_on_rank_one():
    import torch.distributed as dist

    from notebook_accel import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise ValueError("a bad batch on rank 1")  # the line the error must show
    dist.barrier()


def test_an_error_names_the_rank_its_node_and_the_line(ray_cluster):
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(fails_on_rank_one, live=False, **ON_TWO_NODES)
    error = raised.value
    assert error.rank == 1
    assert str(error).startswith("worker rank 1 on node 127.0.0.1 (")
    assert "raised ValueError: a bad batch on rank 1" in str(error)
    assert 'raise ValueError("a bad batch on rank 1")  # the line the error must show' in str(error)
    assert f'File "{__file__}"' in error.traceback
    # The agents were not at fault: they stay warm, and the next launch uses them.
    assert notebook_launcher(chatty, (1,), live=False, **ON_TWO_NODES) == 0


def steps_forever(seconds_each: float):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    total = torch.zeros(1)
    step = 0
    while True:
        total += accelerator.reduce(torch.ones(1))
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(seconds_each)


class PressStopAt(RunObserver):
    """Presses the notebook's stop button (SIGINT to this process) when a line appears."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.pressed_at: float | None = None

    def on_event(self, event, report) -> None:
        if isinstance(event, OutputLine) and event.line == self.line and self.pressed_at is None:
            self.pressed_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)


def test_stop_mid_step_frees_every_agent_group_and_cpu_at_once(ray_cluster):
    handler = signal.getsignal(signal.SIGINT)
    stop = PressStopAt("step 3\n")
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(steps_forever, (0.05,), observers=[stop], live=False, **ON_TWO_NODES)
    assert wait_until_nothing_is_left(ray_cluster) == []
    assert time.monotonic() - stop.pressed_at < PROMPTLY  # the run steps forever
    assert signal.getsignal(signal.SIGINT) is handler
    assert last_run().status == "stopped"
    assert notebook_launcher(chatty, (1,), live=False, **ON_TWO_NODES) == 0


def test_timeout_stops_the_run_and_frees_the_cluster(ray_cluster):
    # The run steps forever: only the timeout ends it within the test's limit.
    with pytest.raises(TimeoutError, match="did not finish within timeout=4.0 s"):
        notebook_launcher(steps_forever, (0.1,), timeout=4, live=False, **ON_TWO_NODES)
    assert wait_until_nothing_is_left(ray_cluster) == []


def test_a_relaunch_reuses_the_warm_agents_and_a_run_can_release_them(ray_cluster):
    first = notebook_launcher(train, (1,), return_all=True, live=False, **ON_TWO_NODES)
    again = notebook_launcher(train, (1,), return_all=True, live=False, **ON_TWO_NODES)
    assert [v["agent"] for v in again] == [v["agent"] for v in first]
    # Another shape cannot reuse them: they are released and new ones made.
    other = notebook_launcher(train, (1,), live=False, cluster="ray", num_processes=1)
    assert other["agent"] not in {v["agent"] for v in first}


def test_warm_agents_are_released_after_keep_warm(ray_cluster):
    notebook_launcher(chatty, (1,), keep_warm=1, live=False, **ON_TWO_NODES)
    assert wait_until_nothing_is_left(ray_cluster, seconds=4.0) == []


def fails_first(seconds: float):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and accelerator.process_index == 1:
        raise RuntimeError("the first attempt fails")
    return (attempt, os.getppid())


def test_max_restarts_starts_every_worker_again_on_the_same_agents(ray_cluster):
    attempt, agent = notebook_launcher(
        fails_first, (0,), max_restarts=1, live=False, **ON_TWO_NODES
    )
    assert attempt == 1
    assert last_run().restarts == 1
    assert psutil.pid_exists(agent)


def test_mixed_precision_and_accumulation_come_from_the_launch(ray_cluster):
    value = notebook_launcher(train, (1,), mixed_precision="bf16", live=False, **ON_TWO_NODES)
    assert value["precision"] == "bf16"


def test_every_connection_of_the_cluster_stays_on_loopback(ray_cluster):
    notebook_launcher(train, (1,), live=False, keep_warm=30, **ON_TWO_NODES)
    pids = ray_cluster.process_ids() | {os.getpid()}
    outside = []
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        for connection in connections:
            for end in (connection.laddr, connection.raddr):
                if end and not _loopback_or_any(end.ip):
                    outside.append((pid, connection))
    assert outside == []


def _loopback_or_any(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


# -- bad input: a clear error, nothing started --------------------------------------------


def test_more_workers_than_the_cluster_has_is_refused_at_once(ray_cluster):
    started = time.monotonic()
    with pytest.raises(PlacementError) as raised:
        notebook_launcher(chatty, (1,), num_processes=3, cluster="ray", live=False)
    assert time.monotonic() - started < PROMPTLY  # Ray would wait forever for the group
    assert "it asks for 3 workers of 1 CPU each" in str(raised.value)
    assert "the cluster has 2 CPUs in all, on 2 nodes: node 127.0.0.1 (" in str(raised.value)
    assert "Nothing was started" in str(raised.value)
    with pytest.raises(PlacementError, match="all on one node"):
        notebook_launcher(
            chatty, (1,), num_processes=2, cluster="ray", placement_strategy="STRICT_PACK"
        )
    with pytest.raises(PlacementError, match="backend='cuda' needs GPUs"):
        notebook_launcher(chatty, (1,), cluster="ray", backend="cuda")


def test_what_cannot_travel_to_the_nodes_is_refused_before_anything_starts(ray_cluster):
    with pytest.raises(TypeError, match="cannot be pickled") as raised:
        notebook_launcher(chatty, (threading.Lock(),), cluster="ray", live=False)
    assert "lock" in str(raised.value)


def test_another_address_than_the_connected_cluster_s_is_refused(ray_cluster):
    elsewhere = "127.0.0.1:1"
    with pytest.raises(ConnectionError, match="this kernel is connected to the Ray cluster at"):
        notebook_launcher(chatty, (1,), cluster="ray", ray_address=elsewhere, live=False)


# -- checkpoints on each node's own disk ----------------------------------------------------


def train_and_save(project_name: str, stop_at: int | None = None):
    """6 steps per epoch, 2 epochs, resuming from the newest checkpoint of the project;
    each rank's project lives on its own node's disk (nothing is shared)."""
    from notebook_accel import (
        Accelerator,
        DataLoaderConfiguration,
        ProjectConfiguration,
        latest_checkpoint,
        set_seed,
    )

    project = os.path.join(os.environ["NODE_DISK"], project_name)
    set_seed(0, device_specific=True)
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True),
    )
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=generator), torch.randn(48, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if latest_checkpoint(project):
        accelerator.load_state()  # mid-epoch: the loader goes on from the saved batch
    steps = 0
    for _epoch in range(loader.epoch, 2):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == stop_at:
                accelerator.save_state()
                return sorted(os.listdir(os.path.join(project, "checkpoints", "checkpoint_0")))
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def test_checkpoints_on_each_node_s_own_disk_resume_bit_for_bit(ray_cluster):
    reference = notebook_launcher(train_and_save, ("uninterrupted",), live=False, **ON_TWO_NODES)
    files = notebook_launcher(
        train_and_save, ("resumed", 9), return_all=True, live=False, **ON_TWO_NODES
    )
    assert "random_states_0.pkl" in files[0] and "random_states_1.pkl" not in files[0]
    assert "random_states_1.pkl" in files[1] and "random_states_0.pkl" not in files[1]
    assert "model.safetensors" in files[0]  # the shared files: on the main process's disk
    resumed = notebook_launcher(train_and_save, ("resumed",), live=False, **ON_TWO_NODES)
    for mine, theirs in zip(resumed, reference, strict=True):
        assert torch.equal(mine, theirs), (mine - theirs).abs().max().item()


# -- a breakpoint on another node ---------------------------------------------------------


def stops_then_fails(fail: bool):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    value = torch.tensor([float(accelerator.process_index + 1)])
    if accelerator.process_index == 1:
        if fail:
            window = [1, 2][:1]
            return window[3]
        breakpoint()
    return accelerator.reduce(value).item()


def test_a_breakpoint_and_a_post_mortem_on_another_node_prompt_in_the_cell(
    ray_cluster, monkeypatch, capfd
):
    from notebook_accel.launch import debugging

    answers, prompts = ["p value", "value += 10", "c", "p window", "c"], []

    def user(prompt: str = "") -> str:
        prompts.append(prompt)
        return answers.pop(0)

    monkeypatch.setattr(debugging, "input", user, raising=False)
    total = notebook_launcher(stops_then_fails, args=(False,), timeout=120, **ON_TWO_NODES)
    assert total == 13.0  # rank 1's value changed at its prompt, on its own node
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(
            stops_then_fails, args=(True,), timeout=120, post_mortem=True, **ON_TWO_NODES
        )
    assert raised.value.rank == 1 and "IndexError" in str(raised.value).splitlines()[0]
    assert prompts == ["[rank 1] (Pdb) "] * 5
    out = capfd.readouterr().out
    assert "[rank 1] tensor([2.])" in out and "[rank 1] [1]" in out


# -- the panel ---------------------------------------------------------------------------


def test_the_panel_launches_on_the_cluster_and_its_stop_frees_everything(ray_cluster):
    from notebook_accel.platforms import Hardware
    from notebook_accel.ui.panel import LaunchPanel

    panel = LaunchPanel(chatty, args=(3,), hardware=Hardware(cpu_cores=2))
    panel.where.value = "ray"
    panel.ray_address.value = ray_cluster.address
    panel.launch()
    assert panel.wait(120) and panel.error is None, panel.error
    assert panel.result == 0
    assert "[rank 1] line 2 of rank 1" in panel.run_widgets.logs.value
    panel.function, panel.args = steps_forever, (0.05,)
    panel.launch()
    deadline = time.monotonic() + 60
    while "step 3" not in panel.run_widgets.logs.value and time.monotonic() < deadline:
        time.sleep(0.05)
    pressed = time.monotonic()
    panel.stop()
    assert panel.wait(PROMPTLY)
    assert isinstance(panel.error, KeyboardInterrupt) and "Stopped" in panel.outcome.value
    assert wait_until_nothing_is_left(ray_cluster) == []
    assert time.monotonic() - pressed < PROMPTLY  # the run steps forever


# -- other ways to reach the cluster ---------------------------------------------------------


def test_the_kernel_s_connection_is_used_as_it_is(ray_cluster):
    assert ray.is_initialized()
    assert notebook_launcher(chatty, (1,), cluster="ray", ray_address="auto", live=False) == 0


ANOTHER_DRIVER = """
from notebook_accel import notebook_launcher
import ray

def hello():
    import torch
    from notebook_accel import Accelerator
    accelerator = Accelerator()
    return accelerator.reduce(torch.ones(1)).item()

for address in ADDRESSES:
    value = notebook_launcher(hello, cluster="ray", ray_address=address, num_processes=2,
                              placement_strategy="STRICT_SPREAD", live=False)
    print("RESULT", address, value)
"""


@pytest.mark.cold_cluster  # another driver: the CPUs this process keeps warm are free
@pytest.mark.parametrize("through", ["gcs", "client"])
def test_a_kernel_reaches_a_running_cluster_by_its_address(ray_cluster, through):
    """A fresh kernel (another driver): $RAY_ADDRESS or "auto", or Ray Client (ray://)."""
    import subprocess
    import sys

    if through == "gcs":
        addresses, env = [None, "auto"], {**os.environ, "RAY_ADDRESS": ray_cluster.address}
    else:
        addresses, env = [ray_cluster.client_address] * 2, dict(os.environ)
        env.pop("RAY_ADDRESS", None)
    code = ANOTHER_DRIVER.replace("ADDRESSES", repr(addresses))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[-1] for line in done.stdout.splitlines() if "RESULT" in line] == [
        "2.0",
        "2.0",
    ]
