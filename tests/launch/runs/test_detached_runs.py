"""Detached runs from this process, as from a kernel: the keeper killed mid-run takes its
workers along and the run shows as lost with its checkpoint; resuming goes on from it to
the weights of a run never interrupted. Bad inputs are refused before anything starts."""

from __future__ import annotations

import os
import signal
import stat
import time

import psutil
import pytest
import torch

from notebook_accel import (
    RunLostError,
    attach,
    notebook_launcher,
    resume,
    runs,
)
from notebook_accel.launch.runs.directory import find_run
from tests_support import PROMPTLY

pytestmark = pytest.mark.usefixtures("runs_dir")


class StepCounter:
    """The loop's position, saved with the checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def train_with_checkpoints(project: str, steps: int, hold_at: int | None = None):
    """A run that saves every 5 steps; with `hold_at`, it waits there (to be killed)."""
    from notebook_accel import Accelerator, ProjectConfiguration, resume_checkpoint

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
        if counter.step % 5 == 0:
            accelerator.save_state()
        if counter.step == hold_at:
            print("holding", flush=True)
            time.sleep(600)
    return accelerator.unwrap_model(model).weight.detach().clone()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + PROMPTLY
    while not condition():
        assert time.monotonic() < deadline, f"waited {PROMPTLY} s for {what}"
        time.sleep(0.05)


def test_a_killed_keeper_takes_its_workers_and_resume_goes_on_from_its_checkpoint(tmp_path):
    run = notebook_launcher(
        train_with_checkpoints,
        (str(tmp_path / "detached"), 20, 10),
        num_processes=2,
        backend="cpu",
        detach=True,
    )
    wait_for(lambda: "holding" in run.output(), "the run to reach step 10")
    keeper = run.directory.keeper()
    workers = psutil.Process(keeper.pid).children(recursive=True)
    assert len(workers) >= 2
    keeper.kill(signal.SIGKILL)

    with pytest.raises(RunLostError) as lost:
        run.result(timeout=PROMPTLY)
    assert lost.value.checkpoint.endswith("checkpoint_1")  # saved at steps 5 and 10
    assert run.state == "lost"
    _, alive = psutil.wait_procs(workers, timeout=PROMPTLY)
    assert alive == [], "a worker outlived its keeper"
    (listed,) = runs()
    assert (listed.id, listed.state, listed.checkpoint) == (run.id, "lost", lost.value.checkpoint)

    resumed = resume(run.id)
    weights = resumed.result(timeout=PROMPTLY)
    assert find_run(resumed.id).read().resumed_from == run.id
    assert "holding" not in resumed.output()  # it began at step 10, after the hold
    never_interrupted = notebook_launcher(
        train_with_checkpoints, (str(tmp_path / "attached"), 20), num_processes=2, backend="cpu"
    )
    assert torch.equal(weights, never_interrupted)


def test_bad_inputs_are_refused_before_anything_starts(runs_dir):
    with pytest.raises(TypeError):
        notebook_launcher(print, num_processes=2, backend="cpu", detach=True, no_such_option=1)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())
    with pytest.raises(LookupError, match="no detached run"):
        attach()
    with pytest.raises(LookupError, match="no detached run"):
        resume()


def test_a_single_detached_worker_takes_the_options_of_worker_processes():
    # Detached, one worker runs under the keeper, not in this process: a timeout and
    # restarts apply to it as to any worker process.
    run = notebook_launcher(
        sum, ([1, 2],), num_processes=1, backend="cpu", detach=True, timeout=PROMPTLY,
        max_restarts=1,
    )  # fmt: skip
    assert run.result(timeout=PROMPTLY) == 3


def test_runs_are_private_to_their_user_and_forgotten_on_request(runs_dir):
    runs_dir.mkdir(mode=0o755)
    os.chmod(runs_dir, 0o755)
    run = notebook_launcher(sum, ([1, 2],), num_processes=2, backend="cpu", detach=True)
    assert run.result(timeout=PROMPTLY) == 3
    assert stat.S_IMODE(runs_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.directory.path.stat().st_mode) == 0o700
    for path in run.directory.path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    run.forget()
    assert not run.directory.path.exists() and runs() == []
    if os.getuid() == 0:  # a directory another user owns is refused, not used
        os.chown(runs_dir, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to another user"):
            runs()
        os.chown(runs_dir, 0, 0)
