"""Checkpoints whose processes save into directories of their own: 2 workers, one each.

Accelerate's `test_stateful_dataloader_save_state` gives every process its own
temporary directory; machines without a shared file system are the same case.
Each directory holds its process's own files; the main process's (and with
save_on_each_node every one) the weights and the rest; a resume is bit for
bit; a kill while the directories are committed leaves the previous save
loadable from every directory, and with automatic naming the half-committed
checkpoint_N is passed over; directories of two different saves are
refused on every process before anything changes. (Sharded models:
test_sharded_separate_directories.py; two launcher processes as two nodes:
test_two_nodes.py.)
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import separate_dirs
import torch

from notebook_accel import Accelerator, CheckpointError, WorkerError, notebook_launcher
from notebook_accel.checkpoint.training_state import (
    MANIFEST,
    _choose_save,
    _saved_id,
    list_checkpoints,
)


@pytest.fixture(scope="module", autouse=True)
def optimizer_imports_done_once():
    # The first optimizer built in a process imports torch._dynamo (seconds); do it
    # here, once, so the forked workers inherit it instead of each paying for it.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def _launch(function=separate_dirs.train, *args, **kwargs):
    return notebook_launcher(
        function,
        args=args,
        kwargs=kwargs,
        num_processes=2,
        return_all=True,
        live=False,
        backend="cpu",
        timeout=150,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The weights of a run that never stops, on each rank."""
    results = _launch(separate_dirs.train, str(tmp_path_factory.mktemp("uninterrupted")))
    return [result["weights"] for result in results]


def _manifest(folder):
    return json.loads((folder / MANIFEST).read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_each_node", [False, True], ids=["main-only", "save_on_each_node"])
def test_each_rank_saves_into_its_own_directory_and_resumes_bit_for_bit(
    tmp_path, reference, on_each_node
):
    options = {"per_rank": True, "save_on_each_node": on_each_node}
    assert _launch(separate_dirs.train, str(tmp_path), stop_at=9, **options) == [None, None]
    first, second = (tmp_path / f"rank{r}" / "checkpoints" / "checkpoint_0" for r in (0, 1))
    mine = {"random_states_0.pkl", "loop_state_0.pkl"}
    shared = {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"}
    assert {p.name for p in first.iterdir()} == mine | shared | {MANIFEST}
    theirs = {"random_states_1.pkl", "loop_state_1.pkl", MANIFEST}
    assert {p.name for p in second.iterdir()} == theirs | (shared if on_each_node else set())
    assert (_manifest(first)["ranks"], _manifest(second)["ranks"]) == ([0], [1])
    assert _manifest(second)["shared"] is on_each_node
    assert _manifest(first)["save"] == _manifest(second)["save"]  # one save, two directories

    resumed = _launch(separate_dirs.train, str(tmp_path), **options)
    assert [result["steps"] for result in resumed] == [18, 18]
    for result, weights in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(result["weights"], weights)


@pytest.mark.timeout(300)
def test_a_kill_while_the_directories_are_committed_leaves_the_previous_save_everywhere(
    tmp_path, reference
):
    rank0, rank1 = tmp_path / "rank0", tmp_path / "rank1"
    # Rank 1 dies at its second save (step 6) once rank 0 has committed its directory:
    # rank 0's holds the new save, rank 1's still the one of step 3.
    kill = {
        "rank": 1,
        "target": "state",
        "nth": 2,
        "once_exists": [str(rank0 / "state" / MANIFEST), str(rank0 / ".state.previous")],
    }
    options = {"per_rank": True, "automatic": False, "save_every": 3}
    with pytest.raises(WorkerError) as failure:
        _launch(separate_dirs.train, str(tmp_path), kill=kill, **options)
    assert failure.value.rank == 1 and failure.value.exitcode == -signal.SIGKILL
    older = _saved_id(rank1 / "state")
    assert older and _saved_id(rank0 / ".state.previous") == older
    assert _saved_id(rank0 / "state") not in (None, older)  # half-committed

    resumed = _launch(separate_dirs.train, str(tmp_path), **options)  # loads step 3's save
    for result, weights in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(result["weights"], weights)
    for folder in (rank0, rank1):  # put back, then replaced by later saves; nothing left over
        assert sorted(p.name for p in folder.iterdir()) == ["state"]


@pytest.mark.timeout(300)
def test_a_half_committed_checkpoint_n_is_passed_over_and_numbering_goes_on_after_it(
    tmp_path, reference
):
    checkpoints = [tmp_path / f"rank{rank}" / "checkpoints" for rank in (0, 1)]
    # Rank 1 dies right before committing checkpoint_1 (step 6), once rank 0 has
    # committed it: only rank 0's directory holds the new save.
    kill = {
        "rank": 1,
        "target": "checkpoint_1",
        "nth": 1,
        "once_exists": [str(checkpoints[0] / "checkpoint_1" / MANIFEST)],
    }
    options = {"per_rank": True, "save_every": 3}
    with pytest.raises(WorkerError) as failure:
        _launch(separate_dirs.train, str(tmp_path), kill=kill, **options)
    assert failure.value.rank == 1 and failure.value.exitcode == -signal.SIGKILL
    names = [[p.name for p in list_checkpoints(folder)] for folder in checkpoints]
    assert names == [["checkpoint_0", "checkpoint_1"], ["checkpoint_0"]]
    saves = {_saved_id(folder / "checkpoint_0") for folder in checkpoints}
    assert len(saves) == 1 and None not in saves  # the previous save, whole in both

    # Each directory's newest is another checkpoint; they agree on checkpoint_0.
    resumed = _launch(separate_dirs.train, str(tmp_path), **options)
    for result, weights in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(result["weights"], weights)
    # Numbering went on after the half-committed checkpoint_1 (saves at 6, ..., 18).
    after = [f"checkpoint_{n}" for n in range(2, 7)]
    assert [p.name for p in list_checkpoints(checkpoints[1])] == ["checkpoint_0", *after]


def _save_twice(base):
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    rank = accelerator.process_index
    accelerator.save_state(os.path.join(base, "first", f"rank{rank}"))
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.add_(1)
    accelerator.save_state(os.path.join(base, "second", f"rank{rank}"))


def _try_to_load(folder):
    accelerator = Accelerator()
    model = accelerator.unwrap_model(accelerator.prepare(torch.nn.Linear(2, 2)))
    before = model.weight.detach().clone()
    try:
        accelerator.load_state(folder)
    except CheckpointError as error:
        return str(error), torch.equal(before, model.weight)
    return None, False


def test_directories_of_two_different_saves_are_refused_on_every_process(tmp_path):
    _launch(_save_twice, str(tmp_path))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    os.rename(tmp_path / "first" / "rank0", mixed / "rank0")
    os.rename(tmp_path / "second" / "rank1", mixed / "rank1")
    results = _launch(_load_per_rank, str(mixed))
    for error, unchanged in results:
        assert error is not None and "do not come from one save" in error
        assert unchanged


def _load_per_rank(base):
    return _try_to_load(os.path.join(base, f"rank{os.environ['RANK']}"))


@pytest.mark.parametrize(
    "saved, chosen",
    [
        ([("a", None), ("a", None)], "a"),  # every directory holds one save
        ([("b", "a"), ("a", None)], "a"),  # committed in the first only
        ([("b", "a"), ("b", "a")], "b"),  # committed everywhere, not yet tidied
        ([(None, "a"), ("a", None)], "a"),  # killed between the two renames
        ([("a", None), ("b", None)], None),  # two unrelated saves
        ([(None, None), ("a", None)], None),  # one directory holds nothing
        ([("", None), ("", None)], ""),  # written before save ids were recorded
    ],
)
def test_the_save_every_process_can_load(saved, chosen):
    assert _choose_save(saved) == chosen


def _save_into_own_or_foreign(base):
    accelerator = Accelerator()
    accelerator.prepare(torch.nn.Linear(2, 2))
    folder = os.path.join(base, f"rank{accelerator.process_index}")
    try:
        accelerator.save_state(folder)
    except CheckpointError as error:
        return str(error)


def test_a_bad_target_on_one_process_is_refused_on_every_process_before_anything_is_written(
    tmp_path,
):
    notes = tmp_path / "rank1" / "notes.txt"  # rank 1's directory holds something else
    notes.parent.mkdir()
    notes.write_text("keep me")
    errors = _launch(_save_into_own_or_foreign, str(tmp_path))
    assert "rank1 exists and is not a checkpoint" in errors[1]
    assert errors[0].startswith("process 1: ") and "rank1 exists" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1"]  # rank 0 wrote nothing
    assert notes.read_text() == "keep me"


def test_files_of_processes_that_did_not_see_the_directory_stop_the_save(tmp_path):
    from notebook_accel.checkpoint.training_state import (
        CheckpointContext,
        _Sharing,
        _write_manifest,
    )
    from notebook_accel.config.kwargs import ProjectConfiguration
    from notebook_accel.training.registry import TrainingObjects

    # A file system that showed process 1 its directory late: process 0 saw only its
    # own files, and then process 1's appeared in the same directory.
    for name in ("random_states_0.pkl", "loop_state_0.pkl", "loop_state_1.pkl"):
        (tmp_path / name).write_bytes(b"x")
    run = CheckpointContext(TrainingObjects(), ProjectConfiguration(), num_processes=2)
    sharing = _Sharing(ranks=(0,), directories=2, saved=[(None, None)] * 2)
    with pytest.raises(CheckpointError, match=r"also holds the files of processes \[1\]"):
        _write_manifest(run, tmp_path, "0123456789ab", sharing, sharded=False, shared=True)
    assert not (tmp_path / MANIFEST).exists()
