"""The cluster tests' fixtures: a real Ray cluster (tests/cluster_support.py), and after
every test no agent, placement group or worker process of the test left, and every CPU of
the cluster free again.

The modules that use the cluster as it is share one (starting one costs about 25 s on 2
cores); a module that needs another shape (more nodes, GPUs, nodes it kills) defines its
own `ray_cluster`, and runs before the shared one starts, so two clusters never run at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster_support import (
    LocalCluster,
    start_cluster,
    stop_cluster,
    wait_until_nothing_is_left,
)
from notebook_accel import release_cluster
from tests_support import live_children, mark_test_start

# A cluster test's limit against a hang: a Ray cluster of several nodes on a loaded
# 2-core machine is slow (a test of a few launches took over the suite's 120 s there),
# and a test stopped by the limit leaves Ray mid-call in this process.
CLUSTER_TEST_SECONDS = 300
HERE = Path(__file__).parent


# The modules of each kind of cluster, in the order they run (see the module docstring).
CLUSTER_ORDER = {"own": 0, "shared": 1, "none": 2}
# Each module's kind: that of the first of its tests' clusters in CLUSTER_ORDER.
_module_kinds: dict[Path, str] = {}


def _cluster_of(item: pytest.Item) -> str:
    """Which cluster a test uses: "own" (its module's), "shared", or "none"."""
    definitions = item._fixtureinfo.name2fixturedefs.get("ray_cluster")
    if not definitions:
        return "none"
    defined_in_a_module = definitions[-1].baseid.split("::")[0].endswith(".py")
    return "own" if defined_in_a_module else "shared"


@pytest.hookimpl(trylast=True)  # after the suite's order of files (tests/conftest.py)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [index for index, item in enumerate(items) if item.path.is_relative_to(HERE)]
    ours = [items[index] for index in slots]
    for item in ours:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CLUSTER_TEST_SECONDS))
    # A module runs whole where the first of its tests' clusters puts it: a module split
    # in two would start its module fixtures twice.
    for item in ours:
        _module_kinds[item.path] = min(
            _module_kinds.get(item.path, "none"), _cluster_of(item), key=CLUSTER_ORDER.__getitem__
        )
    ours.sort(key=lambda item: CLUSTER_ORDER[_module_kinds[item.path]])  # stable
    for index, item in zip(slots, ours, strict=True):
        items[index] = item


# The cluster the modules that use it as it is share, from its first test to its last.
_shared: LocalCluster | None = None


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> LocalCluster:
    """A cluster of two nodes of 1 CPU each, shared by the modules that use it as it is;
    it stops after the last test of theirs in a row (pytest_runtest_teardown below)."""
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
    workers) may come and go; the test's agents, placement group and workers may not."""
    uses_cluster = "ray_cluster" in request.fixturenames
    local = request.getfixturevalue("ray_cluster") if uses_cluster else None
    before = mark_test_start()
    yield
    if local is None:  # as the suite's own check does, the shared cluster's processes aside
        theirs = _shared.process_ids() if _shared is not None else set()
        deadline = time.monotonic() + 5
        while (
            left := [c for c in live_children() if c.pid not in before and c.pid not in theirs]
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
        return
    release_cluster()
    left = wait_until_nothing_is_left(local)
    assert not left, f"left on the cluster: {left}"
    theirs = local.process_ids()
    leftover = [c for c in live_children() if c.pid not in before and c.pid not in theirs]
    assert not leftover, f"processes left behind: {[(p.pid, p.name()) for p in leftover]}"
