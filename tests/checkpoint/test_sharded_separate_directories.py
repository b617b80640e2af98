"""Sharded (FSDP2) checkpoints whose processes save into directories of their own.

2 CPU workers shard `separate_dirs.train`'s model, each saving into its own
directory (and 4 workers, two to a directory, as two nodes would): each
writes its own shards (weights and AdamW state, `step` included) where it was
told, in a form it loads back by itself. A resume mid training ends with the
weights of a run that never stopped, bit for bit; a kill while the
directories are committed leaves the previous save loadable everywhere;
another number of processes, or a model that is not sharded the same way, is
refused on every process with what to do, before anything changes.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import separate_dirs
import torch

from notebook_accel import WorkerError, notebook_launcher
from notebook_accel.checkpoint.training_state import MANIFEST, _saved_id


@pytest.fixture(scope="module", autouse=True)
def optimizer_imports_done_once():
    # The first optimizer built in a process imports torch._dynamo (seconds); do it
    # here, once, so the forked workers inherit it instead of each paying for it.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def _launch(function=separate_dirs.train, *args, num_processes=2, **kwargs):
    return notebook_launcher(
        function,
        args=args,
        kwargs=kwargs,
        num_processes=num_processes,
        return_all=True,
        live=False,
        backend="cpu",
        timeout=150 if num_processes > 1 else None,  # one process runs in this one
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The whole weights after a sharded run that never stops, on each rank."""
    results = _launch(separate_dirs.train, str(tmp_path_factory.mktemp("uninterrupted")), fsdp=True)
    return [result["weights"] for result in results]


def _manifest(folder):
    return json.loads((folder / MANIFEST).read_text())


def _files(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_each_node", [False, True], ids=["main-only", "save_on_each_node"])
def test_each_rank_saves_its_own_shards_and_resumes_bit_for_bit(tmp_path, reference, on_each_node):
    options = {"fsdp": True, "per_rank": True, "save_on_each_node": on_each_node}
    assert _launch(separate_dirs.train, str(tmp_path), stop_at=9, **options) == [None, None]
    folders = [tmp_path / f"rank{r}" / "checkpoints" / "checkpoint_0" for r in (0, 1)]
    shared = {"scheduler.bin", "custom_checkpoint_0.pkl"}  # the weights are in the shards
    for rank, folder in enumerate(folders):
        own = {f"random_states_{rank}.pkl", f"loop_state_{rank}.pkl"}
        shards = {f"sharded/rank_{rank}/.metadata", f"sharded/rank_{rank}/__0_0.distcp"}
        has_shared = rank == 0 or on_each_node
        assert _files(folder) == own | shards | {MANIFEST} | (shared if has_shared else set())
        manifest = _manifest(folder)
        assert manifest["sharded"] and manifest["shards_per_process"]
        assert set(manifest["checksums"]) >= shards
    assert _manifest(folders[0])["save"] == _manifest(folders[1])["save"]

    resumed = _launch(separate_dirs.train, str(tmp_path), **options)
    assert [result["steps"] for result in resumed] == [18, 18]
    for result, weights in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(result["weights"], weights)


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:num_processes=4 asks for one CPU core:UserWarning")
def test_processes_sharing_a_directory_each_save_their_shards_there_and_resume_bit_for_bit(
    tmp_path_factory,
):
    """4 processes, two to a directory, as two nodes of 2 with a disk each."""
    options = {"fsdp": True, "node_size": 2}
    reference = _launch(
        separate_dirs.train, str(tmp_path_factory.mktemp("whole")), num_processes=4, **options
    )
    base = tmp_path_factory.mktemp("stopped")
    stopped = _launch(separate_dirs.train, str(base), stop_at=9, num_processes=4, **options)
    assert stopped == [None] * 4
    folders = [base / f"node{node}" / "checkpoints" / "checkpoint_0" for node in (0, 1)]
    for node, folder in enumerate(folders):
        ranks = [2 * node, 2 * node + 1]
        manifest = _manifest(folder)
        assert manifest["ranks"] == ranks and manifest["shards_per_process"]
        shards = {f"sharded/rank_{rank}/__0_0.distcp" for rank in ranks}
        assert set(manifest["checksums"]) >= shards  # the leader lists the other's shards
        assert sorted(p.name for p in (folder / "sharded").iterdir()) == [
            f"rank_{rank}" for rank in ranks
        ]
    # Without save_on_each_node node 1 holds no shared files: they come from node 0.
    assert not (folders[1] / "scheduler.bin").exists()

    resumed = _launch(separate_dirs.train, str(base), num_processes=4, **options)
    assert [result["steps"] for result in resumed] == [18] * 4
    for ours, theirs in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(ours["weights"], theirs["weights"])


@pytest.mark.timeout(300)
def test_a_kill_while_the_directories_are_committed_leaves_the_previous_shards_everywhere(
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
    options = {"fsdp": True, "per_rank": True, "automatic": False, "save_every": 3}
    with pytest.raises(WorkerError) as failure:
        _launch(separate_dirs.train, str(tmp_path), kill=kill, **options)
    assert failure.value.rank == 1 and failure.value.exitcode == -signal.SIGKILL
    older = _saved_id(rank1 / "state")
    assert older and _saved_id(rank0 / ".state.previous") == older
    assert _saved_id(rank0 / "state") not in (None, older)  # half-committed
    assert (rank1 / "state" / "sharded" / "rank_1" / "__0_0.distcp").is_file()

    resumed = _launch(separate_dirs.train, str(tmp_path), **options)  # loads step 3's save
    for result, weights in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(result["weights"], weights)
    for folder in (rank0, rank1):  # put back, then replaced by later saves; nothing left over
        assert sorted(p.name for p in folder.iterdir()) == ["state"]


def _save_at_step_9(base):
    options = {"fsdp": True, "per_rank": True}
    assert _launch(separate_dirs.train, base, stop_at=9, **options) == [None, None]


def _load_own(base, fsdp):
    """Each process tries its own directory's checkpoint."""
    folder = os.path.join(base, f"rank{os.environ['RANK']}", "checkpoints", "checkpoint_0")
    return separate_dirs.try_to_load(folder, fsdp)


@pytest.mark.timeout(300)
def test_another_number_of_processes_is_refused_before_anything_changes(tmp_path):
    _save_at_step_9(str(tmp_path))
    folder = tmp_path / "rank0" / "checkpoints" / "checkpoint_0"
    # One process (node 0 alone, say) with the directory of rank 0.
    [(error, unchanged)] = _launch(separate_dirs.try_to_load, str(folder), True, num_processes=1)
    assert "saved by 2 processes into directories of their own" in error
    assert "resume with num_processes=2" in error and "save_model()" in error
    assert unchanged


@pytest.mark.timeout(300)
def test_shards_that_are_not_this_process_s_are_refused_on_every_process(tmp_path):
    _save_at_step_9(str(tmp_path))
    # The same 2 processes, but the model is not sharded: each holds whole tensors.
    results = _launch(_load_own, str(tmp_path), False)
    for rank, (error, unchanged) in enumerate(results):
        assert "does not hold the shards this process has" in error
        saved = f"model_0.0.weight was saved as the part [8, 4] at [{8 * rank}, 0] of [16, 4]"
        assert f"{saved}, this process holds the whole [16, 4]" in error
        assert "same FSDP settings" in error
        assert unchanged
