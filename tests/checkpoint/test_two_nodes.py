"""Two loopback nodes of 2 workers, each node saving into a directory of its own.

As on machines without a shared file system: node 0's processes see only
node 0's directory, node 1's only node 1's. A run that stops mid-epoch
resumes bit for bit; a worker killed on node 1 while the save of a
checkpoint is being committed (node 0 has committed it, node 1 not) leaves
the previous checkpoint loadable in both directories, and the resumed run
still ends with the weights of a run that never stopped. A model sharded
over the 4 processes (FSDP2) resumes bit for bit too, each process's shards
saved on its own node.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import separate_dirs
import torch

from notebook_accel.checkpoint.training_state import MANIFEST, _saved_id, list_checkpoints
from tests_support import free_port, run_together

NODE_RUN = Path(__file__).with_name("node_run.py")


def _two_nodes(tmp_path: Path, **options) -> list:
    """Run both nodes at once; each node's results (its two ranks'), or its failure."""
    port = free_port()
    outs = [tmp_path / f"results{node}.pt" for node in (0, 1)]
    commands = [
        [
            sys.executable,
            str(NODE_RUN),
            str(outs[node]),
            str(node),
            str(port),
            str(tmp_path / f"node{node}"),
            json.dumps(options),
        ]
        for node in (0, 1)
    ]
    finished = run_together(commands, timeout=240)
    for code, _, err in finished:
        assert code == 0, err[-3000:]
    return [torch.load(out, weights_only=False) for out in outs]


def _weights(nodes: list) -> list:
    return [result["weights"] for node in nodes for result in node]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every rank's weights after a 2 x 2 run that never stops."""
    return _weights(_two_nodes(tmp_path_factory.mktemp("uninterrupted")))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


@pytest.mark.timeout(600)
def test_each_node_saves_into_its_own_directory_and_resumes_mid_epoch_bit_for_bit(
    tmp_path, reference
):
    assert _two_nodes(tmp_path, stop_at=9, save_on_each_node=True) == [[None, None]] * 2
    folders = [tmp_path / f"node{node}" / "checkpoints" / "checkpoint_0" for node in (0, 1)]
    manifests = [_manifest(folder) for folder in folders]
    assert [m["ranks"] for m in manifests] == [[0, 1], [2, 3]]
    assert [m["shared"] for m in manifests] == [True, True]  # weights on each node
    assert manifests[0]["save"] == manifests[1]["save"]
    assert {p.name for p in folders[1].iterdir()} >= {"model.safetensors", "loop_state_3.pkl"}

    resumed = _two_nodes(tmp_path, save_on_each_node=True)
    assert [r["steps"] for node in resumed for r in node] == [18] * 4
    for ours, theirs in zip(_weights(resumed), reference, strict=True):
        assert separate_dirs.same_weights(ours, theirs)


@pytest.mark.timeout(600)
def test_a_kill_during_the_save_on_one_node_leaves_every_directory_loadable(tmp_path, reference):
    checkpoints = [tmp_path / f"node{node}" / "checkpoints" for node in (0, 1)]
    # Rank 2 (node 1's first) dies right before committing checkpoint_1, once node 0
    # has committed it: only node 0 holds the new save.
    kill = {
        "rank": 2,
        "target": "checkpoint_1",
        "nth": 1,
        "once_exists": [str(checkpoints[0] / "checkpoint_1" / MANIFEST)],
    }
    failed = _two_nodes(tmp_path, save_every=3, kill=kill)
    assert failed[1] == {"failed": 2, "exitcode": -signal.SIGKILL}
    assert "failed" in failed[0]  # node 0's workers lost their peers
    names = [[p.name for p in list_checkpoints(folder)] for folder in checkpoints]
    assert names == [["checkpoint_0", "checkpoint_1"], ["checkpoint_0"]]
    saves = {_saved_id(folder / "checkpoint_0") for folder in checkpoints}
    assert len(saves) == 1 and None not in saves  # the previous save, whole in both

    # Each node's newest is another checkpoint; they agree on checkpoint_0.
    resumed = _two_nodes(tmp_path, save_every=3)
    for ours, theirs in zip(_weights(resumed), reference, strict=True):
        assert separate_dirs.same_weights(ours, theirs)
    # Numbering went on after the half-committed checkpoint_1 (saves at 6, ..., 18).
    assert [p.name for p in list_checkpoints(checkpoints[1])][-1] == "checkpoint_6"


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    """Every rank's whole weights after a sharded 2 x 2 run that never stops."""
    return _weights(_two_nodes(tmp_path_factory.mktemp("sharded"), fsdp=True))


@pytest.mark.timeout(600)
def test_a_sharded_model_saves_each_rank_s_shards_on_its_node_and_resumes_bit_for_bit(
    tmp_path, sharded_reference
):
    assert _two_nodes(tmp_path, fsdp=True, stop_at=9) == [[None, None]] * 2
    folders = [tmp_path / f"node{node}" / "checkpoints" / "checkpoint_0" for node in (0, 1)]
    for node, folder in enumerate(folders):
        ranks = [2 * node, 2 * node + 1]
        assert _manifest(folder)["ranks"] == ranks and _manifest(folder)["shards_per_process"]
        assert sorted(p.name for p in (folder / "sharded").iterdir()) == [
            f"rank_{rank}" for rank in ranks
        ]
    # Without save_on_each_node node 1 holds no shared files: they come from node 0.
    assert not (folders[1] / "scheduler.bin").exists()

    resumed = _two_nodes(tmp_path, fsdp=True)
    assert [r["steps"] for node in resumed for r in node] == [18] * 4
    for ours, theirs in zip(_weights(resumed), sharded_reference, strict=True):
        assert separate_dirs.same_weights(ours, theirs)
