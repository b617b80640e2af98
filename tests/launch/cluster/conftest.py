"""The cluster tests' fixtures: a real Ray cluster per module (tests/cluster_support.py), and
after every test no agent, placement group or worker process of the test left, and every
CPU of the cluster free again."""

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CLUSTER_TEST_SECONDS))


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """A cluster of two nodes of 1 CPU each, for one test module."""
    local = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield local
    finally:
        stop_cluster(local)


@pytest.fixture(autouse=True)
def no_leftover_processes(request) -> Iterator[None]:
    """Replaces the suite's check here: the cluster's own processes (raylets, Ray's idle
    workers) may come and go; the test's agents, placement group and workers may not."""
    uses_cluster = "ray_cluster" in request.fixturenames
    local = request.getfixturevalue("ray_cluster") if uses_cluster else None
    before = mark_test_start()
    yield
    if local is None:  # as the suite's own check does
        deadline = time.monotonic() + 5
        while (left := [c for c in live_children() if c.pid not in before]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
        return
    release_cluster()
    left = wait_until_nothing_is_left(local)
    assert not left, f"left on the cluster: {left}"
    theirs = local.process_ids()
    leftover = [c for c in live_children() if c.pid not in before and c.pid not in theirs]
    assert not leftover, f"processes left behind: {[(p.pid, p.name()) for p in leftover]}"
