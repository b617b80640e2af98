"""GPU workers' placement on a cluster whose nodes have GPUs: each rank holds one of its
node's GPUs, and cuda:LOCAL_RANK is that GPU. Two nodes that declare GPUs to Ray (this
machine has none) join the suite's cluster for these tests, and the function only reads
where it was placed: no CUDA is started."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cluster_support import LocalCluster
from notebook_accel import PlacementError, notebook_launcher
from notebook_accel.config.settings import ENV_BACKEND

GPU_NODE = {"num_cpus": 1, "num_gpus": 2}


@pytest.fixture(scope="module")
def gpu_nodes(ray_cluster: LocalCluster) -> Iterator[list]:
    """Two nodes of 2 GPUs (declared) and 1 CPU each, beside the cluster's two without."""
    with ray_cluster.more_nodes(2, **GPU_NODE) as nodes:
        yield nodes


def where_am_i():
    return {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "node_rank": int(os.environ["NODE_RANK"]),
        "visible": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
        "disk": os.environ["NODE_DISK"],
        "backend": os.environ[ENV_BACKEND],
    }


def test_every_gpu_of_the_cluster_gets_a_worker_and_local_rank_names_it(ray_cluster, gpu_nodes):
    # The default on a cluster with GPUs: one worker per GPU, on CUDA.
    places = notebook_launcher(
        where_am_i, cluster="ray", cpus_per_worker=0.25, return_all=True, live=False
    )
    assert [p["rank"] for p in places] == [0, 1, 2, 3]
    by_node: dict[str, list[dict]] = {}
    for place in places:
        by_node.setdefault(place["disk"], []).append(place)
    # The nodes with GPUs only: the other two have none.
    assert set(by_node) == {str(ray_cluster.disks[node.node_id]) for node in gpu_nodes}
    for node_rank, node_places in enumerate(sorted(by_node.values(), key=lambda p: p[0]["rank"])):
        assert [p["local_rank"] for p in node_places] == [0, 1]
        assert {p["local_world_size"] for p in node_places} == {2}
        assert {p["node_rank"] for p in node_places} == {node_rank}
        # Every rank of a node sees the node's two GPUs, in local-rank order, so that
        # cuda:LOCAL_RANK is the GPU Ray gave that rank.
        visible = {tuple(p["visible"]) for p in node_places}
        assert len(visible) == 1 and sorted(visible.pop()) == ["0", "1"]


def test_workers_per_node_puts_that_many_on_each_node(ray_cluster, gpu_nodes):
    places = notebook_launcher(
        where_am_i,
        cluster="ray",
        num_processes=2,
        workers_per_node=1,
        cpus_per_worker=0.25,
        return_all=True,
        live=False,
    )
    assert sorted(p["disk"] for p in places) == sorted(
        str(ray_cluster.disks[node.node_id]) for node in gpu_nodes
    )
    assert [p["local_world_size"] for p in places] == [1, 1]
    assert [len(p["visible"]) for p in places] == [1, 1]


def test_more_gpu_workers_than_gpus_is_refused_naming_each_node_s_gpus(gpu_nodes):
    with pytest.raises(PlacementError) as raised:
        notebook_launcher(where_am_i, cluster="ray", num_processes=5, cpus_per_worker=0.25)
    message = str(raised.value)
    assert "it asks for 5 workers of 1 GPU and 0.25 CPUs each" in message
    assert "the cluster has 4 GPUs in all, on 4 nodes" in message
    for node in gpu_nodes:
        assert f"node 127.0.0.1 ({node.node_id[:8]}) 2 GPUs" in message
