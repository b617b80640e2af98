"""What a launch asks of a Ray cluster, checked without one: bundles, fit, ranks, options."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from notebook_accel import notebook_launcher
from notebook_accel.launch.cluster import connect as connect_module
from notebook_accel.launch.cluster.agent import AgentInfo
from notebook_accel.launch.cluster.connect import CLIENT_ATTEMPTS, CLIENT_SERVER_FAILED
from notebook_accel.launch.cluster.pool import _places
from notebook_accel.launch.cluster.request import ClusterRequest, NodeResources, unmet
from tests_support import PROMPTLY, closed_port


def nodes(*cpus_and_gpus: tuple[float, float]) -> list[NodeResources]:
    return [
        NodeResources(f"{index:02d}" + "a" * 54, f"10.0.0.{index}", cpus, gpus)
        for index, (cpus, gpus) in enumerate(cpus_and_gpus)
    ]


def request(**fields) -> ClusterRequest:
    defaults = {"address": None, "workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1.0}
    return ClusterRequest(**{**defaults, **fields})


def test_one_bundle_per_worker_or_per_node():
    assert request(workers=3).bundles() == [{"CPU": 1.0}] * 3
    per_node = request(workers=4, gpus_per_worker=1, workers_per_node=2, cpus_per_worker=2)
    assert per_node.bundles() == [{"CPU": 4.0, "GPU": 2.0}] * 2
    assert per_node.placement_strategy == "STRICT_SPREAD"
    assert [per_node.bundle_of(worker) for worker in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("strategy", "cluster", "fits"),
    [
        ("PACK", [(1, 0), (1, 0)], True),
        ("SPREAD", [(2, 0)], True),
        ("STRICT_PACK", [(1, 0), (1, 0)], False),
        ("STRICT_PACK", [(2, 0), (1, 0)], True),
        ("STRICT_SPREAD", [(4, 0)], False),
        ("STRICT_SPREAD", [(1, 0), (1, 0)], True),
        ("PACK", [(1, 0)], False),
    ],
)
def test_whether_the_nodes_can_ever_hold_the_workers(strategy, cluster, fits):
    assert (unmet(request(strategy=strategy), nodes(*cluster)) is None) is fits


def test_gpus_are_counted_per_node():
    two_gpus = request(workers=2, gpus_per_worker=1)
    assert unmet(two_gpus, nodes((8, 1), (8, 1))) is None
    why = unmet(request(workers=3, gpus_per_worker=1), nodes((8, 1), (8, 1)))
    assert why == (
        "it asks for 3 workers of 1 GPU and 1 CPU each, packed onto as few nodes as "
        "possible, but the cluster has 2 GPUs in all, on 2 nodes: node 10.0.0.0 (00aaaaaa) "
        "1 GPU, node 10.0.0.1 (01aaaaaa) 1 GPU"
    )


def test_what_the_cluster_lacks_is_said_in_full():
    why = unmet(request(workers=3), nodes((1, 0), (1, 0)))
    assert why == (
        "it asks for 3 workers of 1 CPU each, packed onto as few nodes as possible, but the "
        "cluster has 2 CPUs in all, on 2 nodes: node 10.0.0.0 (00aaaaaa) 1 CPU, "
        "node 10.0.0.1 (01aaaaaa) 1 CPU"
    )
    per_node = unmet(request(workers=4, workers_per_node=2), nodes((2, 0), (1, 0)))
    assert per_node.startswith("it asks for 4 workers of 1 CPU each, 2 on each of 2 nodes")


def info(node: str, gpus: tuple[str, ...] = ()) -> AgentInfo:
    return AgentInfo(node_id=node * 8, address="10.0.0.1", gpu_ids=gpus)


def test_ranks_follow_the_nodes_and_the_first_bundle_s_node_leads():
    # Agents in creation order (bundle order): Ray spread them over two nodes unevenly.
    agents = [info("b", ("3",)), info("a", ("0",)), info("b", ("5",)), info("a", ("1",))]
    places, order = _places(agents)
    assert order == [0, 2, 1, 3]  # node b (bundle 0's) first, each node's ranks together
    assert [(p.rank, p.node_index, p.local_rank, p.local_world_size) for p in places] == [
        (0, 0, 0, 2),
        (1, 0, 1, 2),
        (2, 1, 0, 2),
        (3, 1, 1, 2),
    ]
    assert [p.first_rank for p in places] == [0, 0, 2, 2]
    # cuda:LOCAL_RANK is each rank's own GPU among its node's.
    assert [p.node_gpu_ids for p in places] == [("3", "5"), ("3", "5"), ("0", "1"), ("0", "1")]


def returns_one():
    return 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"ray_address": "auto"},
            "ray_address is for workers on a Ray cluster: pass cluster='ray' too",
        ),
        (
            {"keep_warm": 0, "workers_per_node": 2},
            "workers_per_node, keep_warm are for workers on a Ray cluster",
        ),
        (
            {"cluster": "ray", "num_nodes": 2},
            "num_nodes chooses machines, ports or devices by hand; with cluster='ray', Ray "
            "places the workers",
        ),
        (
            {"cluster": "ray", "backend": "xla"},
            "backend='xla' runs on this machine's TPU only",
        ),
        (
            {"cluster": "ray", "workers_per_node": 1, "placement_strategy": "SPREAD"},
            "leave placement_strategy unset",
        ),
        ({"cluster": "ray", "ray_address": "head"}, "ray_address='head' must be 'auto'"),
        ({"cluster": "ray", "cpus_per_worker": 0}, "cpus_per_worker=0 must be a positive"),
        ({"cluster": "cloud"}, "cluster='cloud' must be one of local, ray"),
    ],
)
def test_options_that_do_not_go_together_are_refused_before_anything_starts(options, message):
    with pytest.raises((ValueError, TypeError)) as raised:
        notebook_launcher(returns_one, live=False, **options)
    assert message in str(raised.value)


def launch_in_a_fresh_process(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A new interpreter, as a kernel that never connected to Ray."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )


def test_without_ray_installed_the_error_says_how_to_install_it():
    done = launch_in_a_fresh_process(
        "import sys; sys.modules['ray'] = None\n"
        "from notebook_accel import notebook_launcher\n"
        "def f(): return 1\n"
        "notebook_launcher(f, cluster='ray')\n"
    )
    assert done.returncode == 1
    assert "ModuleNotFoundError: cluster='ray' runs the workers on a Ray cluster" in done.stderr
    assert 'pip install "notebook_accel[ray]"' in done.stderr


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_nothing_answers_at_is_refused_quickly_and_nothing_starts(scheme):
    with closed_port() as port:  # held for the test: nothing can listen there
        address = f"{scheme}127.0.0.1:{port}"
        started = time.monotonic()
        done = launch_in_a_fresh_process(
            "import ray\n"
            "from notebook_accel import notebook_launcher\n"
            "def f(): return 1\n"
            "try:\n"
            f"    notebook_launcher(f, cluster='ray', ray_address={address!r})\n"
            "except ConnectionError as error:\n"
            "    print('REFUSED', error)\n"
            "print('CONNECTED', ray.is_initialized())\n"
        )
    assert time.monotonic() - started < PROMPTLY  # not Ray's own wait for a cluster
    assert f"REFUSED cannot reach the Ray cluster at {address!r}" in done.stdout, done.stderr
    assert "Nothing was started" in done.stdout
    assert "CONNECTED False" in done.stdout


class FlakyClientServer:
    """ray.init through Ray Client, whose server's process for this driver dies at start
    `failures` times (ray-project/ray#63202) and then starts."""

    def __init__(self, failures: int, message: str = CLIENT_SERVER_FAILED) -> None:
        self.failures, self.message, self.calls = failures, message, 0

    def init(self, address: str, **kwargs) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionAbortedError(f"{self.message}:\nTraceback ... ZombieProcess")


def test_a_client_server_that_failed_to_start_is_asked_again():
    ray = FlakyClientServer(failures=CLIENT_ATTEMPTS - 1)
    connect_module._init(ray, "ray://127.0.0.1:10001")
    assert ray.calls == CLIENT_ATTEMPTS


def test_a_client_server_that_never_starts_fails_after_the_last_attempt():
    ray = FlakyClientServer(failures=CLIENT_ATTEMPTS)
    with pytest.raises(ConnectionAbortedError, match=CLIENT_SERVER_FAILED):
        connect_module._init(ray, "ray://127.0.0.1:10001")
    assert ray.calls == CLIENT_ATTEMPTS


def test_a_client_server_that_never_starts_is_named_with_what_to_do(monkeypatch):
    ray = FlakyClientServer(failures=CLIENT_ATTEMPTS)
    ray.is_initialized = lambda: False
    monkeypatch.setattr(connect_module, "require_ray", lambda: ray)
    monkeypatch.setattr(connect_module, "_check_reachable", lambda address: None)
    with pytest.raises(ConnectionError) as raised:
        connect_module.connect("ray://127.0.0.1:10001")
    said = str(raised.value)
    assert f"its Ray Client server failed to start this kernel's side {CLIENT_ATTEMPTS}" in said
    assert "ray-project/ray#63202" in said and "Run the cell again" in said
    assert "Start one with `ray start --head`" not in said  # the cluster is there


def test_other_refusals_are_not_asked_again():
    ray = FlakyClientServer(failures=1, message="Version mismatch")
    with pytest.raises(ConnectionAbortedError, match="Version mismatch"):
        connect_module._init(ray, "ray://127.0.0.1:10001")
    assert ray.calls == 1
