"""Many launches in one process leak no file descriptors, threads or processes."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.distributed as dist

from notebook_accel import notebook_launcher
from tests_support import live_children

# Every test here runs with forked workers and with workers in fresh interpreters.
pytestmark = pytest.mark.usefixtures("each_start_method")


def all_reduce_once():
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


# Launches in a row: any growth fails the test (each count is held to its value after
# the first launch), so a leak of every launch shows at once; more launches catch one
# that happens now and then. Fresh interpreters cost ~2 s of CPU a launch and share
# the launcher's code from the pipes on with "forkserver", so fewer of those (each
# still starts, runs and ends two workers).
LAUNCHES = {"fork": 20, "forkserver": 20, "spawn": 4}


def test_launches_in_a_row_do_not_grow_fds_threads_or_children(each_start_method):
    me = psutil.Process()
    assert (
        notebook_launcher(all_reduce_once, num_processes=2, backend="cpu") == 2.0
    )  # warm up imports
    fds, threads = me.num_fds(), me.num_threads()
    for _ in range(LAUNCHES[each_start_method]):
        assert notebook_launcher(all_reduce_once, num_processes=2, backend="cpu") == 2.0
    assert me.num_fds() <= fds
    assert me.num_threads() <= threads
    assert live_children() == []
