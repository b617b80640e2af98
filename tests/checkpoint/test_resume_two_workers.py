"""Checkpoints in real two-worker gloo runs: exact resume, atomic saves, recovery, mismatches.

Every run trains the same small model with dropout on a shuffled, seedable
loader (6 steps per epoch per rank, 3 epochs). Run A never stops; the others
stop, crash or restart somewhere and must end with A's weights, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    CheckpointError,
    DataLoaderConfiguration,
    ProjectConfiguration,
    WorkerError,
    last_run,
    latest_checkpoint,
    notebook_launcher,
    set_seed,
)
from notebook_accel.checkpoint import training_state as checkpoint_module
from notebook_accel.checkpoint.training_state import list_checkpoints
from notebook_accel.launch.options import ENV_START_METHOD

N, BATCH, EPOCHS = 48, 4, 3  # 48 samples / (4 per rank x 2 ranks) = 6 steps per epoch


class StepCounter:
    """A user object saved through register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


@pytest.fixture(scope="module", autouse=True)
def optimizer_imports_done_once():
    # The first optimizer built in a process imports torch._dynamo (seconds); do it
    # here, once, so the forked workers inherit it instead of each paying for it.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def _setup(project, precision="no", total_limit=None, width=16):
    set_seed(0, device_specific=True)  # each rank its own dropout masks
    accelerator = Accelerator(
        mixed_precision=precision,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit
        ),
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    prepared = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, counter, *prepared


def _weights(accelerator, model):
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def _kill_on(rank, file_name, target_name):
    """A hook that SIGKILLs this worker right after `rank` wrote `file_name` into the
    unfinished directory of the save of `target_name`."""

    def hook(path):
        if (
            os.environ["RANK"] == str(rank)
            and path.name == file_name
            and path.parent.name.startswith(f".{target_name}.")
            and path.parent.name.endswith(".partial")
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _first(marker):
    """True the first time for this marker file (always, without one)."""
    if marker is None:
        return True
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def train(
    project,
    precision="no",
    stop_at=None,
    save_every=None,
    total_limit=None,
    die_at=None,
    marker=None,
    kill=None,
):
    """Train 3 epochs, resuming from the newest checkpoint in `project` if there is one.

    stop_at=(epoch, batches): save there and return None. save_every: save every so
    many steps. die_at: rank 1 is SIGKILLed after that many steps (once per marker file).
    kill=(rank, file, target): SIGKILL that rank in the middle of the save of target.
    """
    accelerator, counter, model, optimizer, loader, scheduler = _setup(
        project, precision, total_limit
    )
    if kill is not None:
        checkpoint_module.after_written = _kill_on(*kill)
    if latest_checkpoint(project):
        accelerator.load_state()
    for epoch in range(loader.epoch, EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.steps += 1
            if stop_at == (epoch, counter.steps - 6 * epoch):
                accelerator.save_state()
                return None
            if save_every and counter.steps % save_every == 0:
                accelerator.save_state()
            if counter.steps == die_at and accelerator.process_index == 1 and _first(marker):
                os.kill(os.getpid(), signal.SIGKILL)
    return {"weights": _weights(accelerator, model), "steps": counter.steps}


def _launch(*args, **kwargs):
    return notebook_launcher(
        train, args=args, kwargs=kwargs, num_processes=2, return_all=True, live=False, backend="cpu"
    )


def _assert_same_weights(ours, reference):
    assert len(ours) == len(reference)
    for mine, theirs in zip(ours, reference, strict=True):
        assert torch.equal(mine, theirs), (mine - theirs).abs().max().item()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Run A's final weights for each precision, computed once."""
    cache = {}

    def get(precision):
        if precision not in cache:
            project = tmp_path_factory.mktemp(f"run_a_{precision}")
            cache[precision] = _launch(project, precision)[0]
        return cache[precision]

    return get


MID_EPOCH, EPOCH_END = (1, 3), (1, 6)


# Every pair of way to ship the function (tests/conftest.py, each_way_to_ship), stop
# point and precision, each in at least one run (four runs, not all eight combinations:
# none of the three depends on the other two).
@pytest.mark.parametrize(
    ("start_method", "stop_at", "precision"),
    [
        ("fork", MID_EPOCH, "no"),
        ("fork", EPOCH_END, "bf16"),
        ("forkserver", MID_EPOCH, "bf16"),
        ("forkserver", EPOCH_END, "no"),
    ],
    ids=lambda value: {MID_EPOCH: "mid-epoch", EPOCH_END: "epoch-end"}.get(value, value),
)
def test_resume_in_a_new_launch_matches_an_uninterrupted_run(
    tmp_path, uninterrupted, monkeypatch, start_method, stop_at, precision
):
    monkeypatch.setenv(ENV_START_METHOD, start_method)
    assert _launch(tmp_path, precision, stop_at=stop_at) == [None, None]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["checkpoint_0"]
    resumed = _launch(tmp_path, precision)
    reference = uninterrupted(precision)
    assert resumed[0]["steps"] == reference["steps"] == 18
    _assert_same_weights(resumed[0]["weights"], reference["weights"])
    _assert_same_weights(resumed[1]["weights"], reference["weights"])


@pytest.mark.parametrize(
    "kill",
    [
        (1, "random_states_1.pkl"),  # a rank's first file
        (0, "model.safetensors"),  # between the main process's shared files
        (0, "checkpoint.json"),  # everything written, not yet renamed into place
    ],
    ids=["rank1-first-file", "rank0-between-files", "rank0-before-rename"],
)
def test_a_worker_killed_during_a_save_leaves_the_previous_checkpoint(
    tmp_path, uninterrupted, kill
):
    rank, file_name = kill
    with pytest.raises(WorkerError) as failure:
        _launch(tmp_path, save_every=3, kill=(rank, file_name, "checkpoint_1"))
    assert failure.value.rank == rank and failure.value.exitcode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["checkpoint_0"]
    [broken] = checkpoints.glob(".checkpoint_1.*.partial")  # the broken one, hidden
    assert not (checkpoints / "checkpoint_1").exists()
    # The next launch resumes from checkpoint_0 and ends where run A ends.
    resumed = _launch(tmp_path, save_every=3)
    _assert_same_weights(resumed[0]["weights"], uninterrupted("no")["weights"])
    assert not broken.exists()


@pytest.mark.usefixtures("each_start_method")
def test_a_worker_that_dies_once_is_restarted_and_the_run_ends_as_if_it_never_died(
    tmp_path, uninterrupted, capsys
):
    marker = tmp_path / "died-once"
    results = notebook_launcher(
        train,
        args=(tmp_path,),
        kwargs={"save_every": 4, "total_limit": 2, "die_at": 7, "marker": str(marker)},
        num_processes=2,
        max_restarts=1,
        return_all=True,
        live=False,
        backend="cpu",
    )
    assert marker.exists() and last_run().restarts == 1
    _assert_same_weights(results[0]["weights"], uninterrupted("no")["weights"])
    assert results[0]["steps"] == 18
    # Saved at steps 4, 8, 12, 16 (the first attempt saved step 4 only): two kept.
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["checkpoint_2", "checkpoint_3"]
    message = capsys.readouterr().err
    assert "worker rank 1 was killed by SIGKILL" in message and "restart" in message


def test_when_restarts_run_out_the_last_worker_error_is_raised(tmp_path):
    with pytest.raises(WorkerError) as failure:
        notebook_launcher(
            train,
            args=(tmp_path,),
            kwargs={"save_every": 4, "die_at": 5},  # no marker: dies on every attempt
            num_processes=2,
            max_restarts=1,
            live=False,
            backend="cpu",
        )
    assert failure.value.rank == 1 and failure.value.exitcode == -signal.SIGKILL
    assert last_run().restarts == 1


# -- mismatches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A checkpoint saved by two workers in the middle of epoch 1."""
    project = tmp_path_factory.mktemp("saved")
    _launch(project, stop_at=(1, 3))
    return project / "checkpoints" / "checkpoint_0"


def load_into(folder, width):
    """Try to load `folder` into a model of `width`; report what happened and what changed."""
    accelerator, _, model, *_ = _setup(folder.parent.parent / "other", width=width)
    before = _weights(accelerator, model)
    try:
        accelerator.load_state(folder)
    except CheckpointError as error:
        unchanged = all(
            torch.equal(a, b) for a, b in zip(before, _weights(accelerator, model), strict=True)
        )
        return {"error": str(error), "unchanged": unchanged}
    return {"error": None}


def test_a_checkpoint_from_another_world_size_is_refused(saved_checkpoint):
    accelerator, *_ = _setup(saved_checkpoint.parent.parent / "single")  # one process
    with pytest.raises(CheckpointError, match="saved by 2 processes, but this run has 1"):
        accelerator.load_state(saved_checkpoint)


def test_a_model_of_another_shape_is_refused_on_every_rank_and_nothing_changes(
    saved_checkpoint,
):
    results = notebook_launcher(
        load_into,
        args=(saved_checkpoint, 32),
        num_processes=2,
        return_all=True,
        live=False,
        backend="cpu",
    )
    for result in results:
        assert "model.safetensors does not fit model 0" in result["error"]
        assert "0.weight has shape [16, 4] in the file but [32, 4] in the model" in result["error"]
        assert result["unchanged"]


def test_a_truncated_file_of_one_rank_is_refused_on_every_rank(saved_checkpoint, tmp_path):
    broken = tmp_path / "checkpoints" / "checkpoint_0"
    shutil.copytree(saved_checkpoint, broken)
    victim = broken / "random_states_1.pkl"
    victim.write_bytes(victim.read_bytes()[:100])
    results = notebook_launcher(
        load_into, args=(broken, 16), num_processes=2, return_all=True, live=False, backend="cpu"
    )
    for result in results:
        assert "random_states_1.pkl is corrupted: 100 bytes" in result["error"]
        assert result["unchanged"]
