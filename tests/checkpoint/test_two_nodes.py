"""Two loopback nodes of 2 workers, each node saving into a directory of its own.

As on machines without a shared file system: two launcher processes, node 0's
processes given only node 0's directory, node 1's only node 1's. A run that
stops mid-epoch resumes bit for bit. The other scenarios of directories of
their own (a kill during the commit, automatic naming passing over a
half-committed checkpoint, sharded models, several processes per directory)
do not depend on how the processes were launched: they run in one launcher,
in test_separate_directories.py and test_sharded_separate_directories.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import separate_dirs
import torch

from notebook_accel.checkpoint.training_state import MANIFEST
from tests_support import run_together, suite_port

NODE_RUN = Path(__file__).with_name("node_run.py")


def _two_nodes(tmp_path: Path, runs: list[tuple[str, dict]]) -> list[list]:
    """Make the runs (each a directory name and `train`'s options) one after another on
    both nodes at once; each run's results of every rank, in rank order."""
    # A port for each run: a node going on to the next run cannot reach the other
    # node's store of the run before.
    ports = [suite_port() for _ in runs]
    plans = [
        [
            {"port": port, "base": str(tmp_path / name / f"node{node}"), "options": options}
            for (name, options), port in zip(runs, ports, strict=True)
        ]
        for node in (0, 1)
    ]
    outs = [tmp_path / f"results{node}.pt" for node in (0, 1)]
    commands = [
        [sys.executable, str(NODE_RUN), str(outs[node]), str(node), json.dumps(plans[node])]
        for node in (0, 1)
    ]
    finished = run_together(commands, timeout=240)
    if any(code != 0 for code, _, _ in finished):  # both nodes' errors in full
        pytest.fail(
            "\n\n".join(
                f"node {n} exited {c}:\n{e[-3000:]}" for n, (c, _, e) in enumerate(finished)
            )
        )
    node0, node1 = (torch.load(out, weights_only=False) for out in outs)
    return [ranks0 + ranks1 for ranks0, ranks1 in zip(node0, node1, strict=True)]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


@pytest.mark.timeout(300)
def test_each_node_saves_into_its_own_directory_and_resumes_mid_epoch_bit_for_bit(tmp_path):
    options = {"save_on_each_node": True}
    reference, stopped, resumed = _two_nodes(
        tmp_path,
        [("uninterrupted", options), ("run", {**options, "stop_at": 9}), ("run", options)],
    )
    assert stopped == [None] * 4
    # The resumed run made no save: checkpoint_0 is the one the stopped run left.
    folders = [tmp_path / "run" / f"node{node}" / "checkpoints" / "checkpoint_0" for node in (0, 1)]
    manifests = [_manifest(folder) for folder in folders]
    assert [m["ranks"] for m in manifests] == [[0, 1], [2, 3]]
    assert [m["shared"] for m in manifests] == [True, True]  # weights on each node
    assert manifests[0]["save"] == manifests[1]["save"]
    assert {p.name for p in folders[1].iterdir()} >= {"model.safetensors", "loop_state_3.pkl"}

    assert [result["steps"] for result in resumed] == [18] * 4
    for ours, theirs in zip(resumed, reference, strict=True):
        assert separate_dirs.same_weights(ours["weights"], theirs["weights"])
