"""The cluster tests' fixtures: a real Ray cluster (tests/cluster_support.py), and after
every test no agent, placement group or worker process of the test left, and every CPU of
the cluster free again, but for the agents this process keeps warm for its next launch.

The agents a run keeps warm (`keep_warm`, 120 s by default) serve the next test, as they
serve a notebook's next launch of the same shape: starting two agents costs about 10 s of
CPU (a Ray worker process each, importing torch), a warm relaunch a fiftieth of that. A
module whose tests launch only from this process opts in (WARM_MODULES); any other test,
and one marked `cold_cluster` (its launch comes from another process, which needs the
cluster's CPUs free), starts and ends with them released.

The modules share one cluster of two nodes (starting one costs about 25 s on 2 cores): a
module that needs another shape (more nodes, GPUs, nodes it kills) adds nodes to it for a
while and leaves it as it found it (`LocalCluster.more_nodes`). Its tests run in a row, the
others' after them, so that the cluster starts once and stops after its last test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cluster_support import (
    LocalCluster,
    end_leftovers,
    end_processes,
    start_cluster,
    stop_cluster,
    wait_until_nothing_is_left,
    warm_pool,
)
from notebook_accel import release_cluster
from tests_support import live_children, mark_test_start

# A cluster test's limit against a hang: a Ray cluster of several nodes on a loaded
# 2-core machine is slow (a test of a few launches took over the suite's 120 s there),
# and a test stopped by the limit leaves Ray mid-call in this process.
CLUSTER_TEST_SECONDS = 300
HERE = Path(__file__).parent


# Modules whose tests may start with the agents the test before kept warm.
WARM_MODULES = {"test_ray_launch.py", "test_ray_live.py"}

# The tests of the cluster first, then the others.
CLUSTER_ORDER = {"shared": 0, "none": 1}
# Each module's kind: "shared" if any of its tests uses the cluster.
_module_kinds: dict[Path, str] = {}


def _cluster_of(item: pytest.Item) -> str:
    return "shared" if "ray_cluster" in item.fixturenames else "none"


@pytest.hookimpl(trylast=True)  # after the suite's order of files (tests/conftest.py)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [index for index, item in enumerate(items) if item.path.is_relative_to(HERE)]
    ours = [items[index] for index in slots]
    for item in ours:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CLUSTER_TEST_SECONDS))
    # A module runs whole where the first of its tests' kinds puts it: a module split
    # in two would start its module fixtures twice.
    for item in ours:
        _module_kinds[item.path] = min(
            _module_kinds.get(item.path, "none"), _cluster_of(item), key=CLUSTER_ORDER.__getitem__
        )
    ours.sort(key=lambda item: CLUSTER_ORDER[_module_kinds[item.path]])  # stable
    for index, item in zip(slots, ours, strict=True):
        items[index] = item


# The cluster the modules share, from its first test to its last.
_shared: LocalCluster | None = None


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> LocalCluster:
    """A cluster of two nodes of 1 CPU each, shared by the modules; it stops after the
    last test of theirs in a row (pytest_runtest_teardown below)."""
    global _shared
    if _shared is None:
        _shared = start_cluster(tmp_path_factory.mktemp("cluster"))
    return _shared


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        local, _shared = _shared, None
        stop_cluster(local)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the test's own fixtures end first
    following = None if nextitem is None else _module_kinds.get(nextitem.path)
    if _shared is not None and following != "shared":
        _stop_shared()


def pytest_sessionfinish() -> None:
    _stop_shared()  # a run stopped early (-x, a stop press) ends it too


@pytest.fixture(autouse=True)
def no_leftover_processes(request) -> Iterator[None]:
    """Replaces the suite's check here: the cluster's own processes (raylets, Ray's idle
    workers) may come and go, and the agents kept warm stay; the test's other agents,
    placement groups and workers may not. What is found is ended, the warm agents too,
    before the test fails, so the next test finds the cluster free."""
    uses_cluster = "ray_cluster" in request.fixturenames
    local = request.getfixturevalue("ray_cluster") if uses_cluster else None
    cold = request.node.get_closest_marker("cold_cluster") is not None
    warm = request.node.path.name in WARM_MODULES and not cold
    if local is not None and not warm:
        release_cluster()
    before = mark_test_start()
    yield
    if local is None:  # as the suite's own check does, the shared cluster's processes aside
        theirs = _shared.process_ids() if _shared is not None else set()
        deadline = time.monotonic() + 5
        while (
            left := [c for c in live_children() if c.pid not in before and c.pid not in theirs]
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        named = _named(left)  # before they end
        end_processes({c.pid for c in left})
        assert not left, f"processes left behind: {named}"
        return
    on_cluster: list[str] = []
    leftover: list[psutil.Process] = []
    try:
        if not warm:
            release_cluster()
        on_cluster = wait_until_nothing_is_left(local, warm=warm_pool() if warm else None)
        theirs = local.process_ids()
        leftover = [c for c in live_children() if c.pid not in before and c.pid not in theirs]
        named = _named(leftover)  # before they end
    finally:
        end_processes({c.pid for c in leftover})
        if on_cluster:
            release_cluster()
            end_leftovers(local)
            wait_until_nothing_is_left(local)  # the next test's check sees only its own
    assert not on_cluster, f"left on the cluster: {on_cluster}"
    assert not leftover, f"processes left behind: {named}"


def _named(processes: list[psutil.Process]) -> list[tuple[int, str]]:
    named = []
    for process in processes:
        try:
            named.append((process.pid, process.name()))
        except psutil.Error:
            named.append((process.pid, "(gone)"))
    return named
