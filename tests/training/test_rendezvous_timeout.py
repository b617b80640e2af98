"""Forming the process group has a short timeout of its own."""

from __future__ import annotations

import os
import time

import pytest

from notebook_accel import Accelerator, WorkerError, notebook_launcher
from tests_support import PROMPTLY


def rank1_never_joins():
    os.environ["NOTEBOOK_ACCEL_RENDEZVOUS_TIMEOUT"] = "2"
    if os.environ["RANK"] == "1":
        time.sleep(600)  # alive, but never creates its Accelerator
    Accelerator()


def test_a_rank_that_never_joins_is_reported_after_the_rendezvous_timeout():
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(rank1_never_joins, num_processes=2, live=False, backend="cpu")
    assert time.monotonic() - started < PROMPTLY  # rank 1 sleeps for 600 s
    error = caught.value
    assert error.rank == 0
    assert "waited 2 s for all 2 processes to join" in str(error)
    assert "Every process must create its Accelerator" in error.traceback
