"""Launching on a Ray cluster: notebook_launcher(cluster="ray") against Ray Train's TorchTrainer.

Both run the same function on the same local Ray cluster, in this same process:
2 workers, one per node, each builds a small model and an AdamW optimizer,
wraps the model for data parallelism (prepare, or Ray Train's prepare_model),
takes one optimizer step and records when. Two figures per launch:
  first step  from the call until every worker has taken its first optimizer step
  whole       the whole call, until it returns
for the first launch on the cluster and for the relaunches after it (the
median of several). Ours runs first, so TorchTrainer gets the cluster's
already-started Ray worker processes. The cluster is two nodes of 1 CPU each
(ray.cluster_utils), kept on the loopback interface.

    python bench/cluster.py [--relaunches 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported

import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from notebook_accel import notebook_launcher, release_cluster  # noqa: E402


def mark_first_step(directory: str, rank: int) -> None:
    Path(directory, str(rank)).write_text(repr(time.time()))


def ours_fn(directory: str):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(32, 64)).sum())
    optimizer.step()
    mark_first_step(directory, accelerator.process_index)


def ray_train_fn(config: dict):
    import ray.train
    import ray.train.torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
    mark_first_step(config["directory"], ray.train.get_context().get_world_rank())


def run_ours(directory: str) -> None:
    notebook_launcher(
        ours_fn,
        (directory,),
        num_processes=2,
        cluster="ray",
        placement_strategy="STRICT_SPREAD",
        live=False,
    )


def run_torch_trainer(directory: str, storage: str) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        ray_train_fn,
        train_loop_config={"directory": directory},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=storage),
    ).fit()


def measure(run, times: int) -> list[tuple[float, float]]:
    """(first step, whole call) in seconds for `times` launches in a row."""
    found = []
    for _ in range(times):
        with tempfile.TemporaryDirectory() as directory:
            started = time.time()
            run(directory)
            whole = time.time() - started
            steps = [float(Path(directory, name).read_text()) for name in os.listdir(directory)]
            assert len(steps) == 2, steps
            found.append((max(steps) - started, whole))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relaunches", type=int, default=5)
    args = parser.parse_args()
    import ray.train.torch  # noqa: F401 - imported before any clock starts, for both

    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="ray-train-")
    try:
        ours = measure(run_ours, 1 + args.relaunches)
        release_cluster()
        theirs = measure(lambda d: run_torch_trainer(d, storage), 1 + args.relaunches)
    finally:
        release_cluster()
        ray.shutdown()
        cluster.shutdown()
    print_table(ours, theirs)


def print_table(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> None:
    def median(samples: list[tuple[float, float]], index: int) -> float:
        return statistics.median(sample[index] for sample in samples)

    rows = [
        ("first launch: call -> every worker's first step", ours[0][0], theirs[0][0]),
        ("first launch: whole call", ours[0][1], theirs[0][1]),
        ("relaunch (median): call -> first step", median(ours[1:], 0), median(theirs[1:], 0)),
        ("relaunch (median): whole call", median(ours[1:], 1), median(theirs[1:], 1)),
    ]
    print("| 2 workers, one per node | notebook_accel (s) | TorchTrainer (s) | ratio |")
    print("|---|---|---|---|")
    for label, mine, reference in rows:
        print(f"| {label} | {mine:.2f} | {reference:.2f} | {mine / reference:.2f}x |")
    print("(goal: first launch at most 1.0x TorchTrainer's, relaunch at most 0.2x)")


if __name__ == "__main__":
    main()
