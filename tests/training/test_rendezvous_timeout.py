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


def rank1_returns_without_joining(rank1_first: bool, leave_by_exit: bool):
    # Rank 1 leaves either before rank 0 starts to wait or while it waits.
    time.sleep(0.0 if (os.environ["RANK"] == "1") == rank1_first else 1.0)
    if os.environ["RANK"] == "1":
        if leave_by_exit:
            raise SystemExit(0)
        return "rank 1 left early"
    Accelerator()


@pytest.mark.parametrize("rank1_first", [True, False], ids=["before", "while_waiting"])
@pytest.mark.parametrize("leave_by_exit", [False, True], ids=["return", "exit_0"])
def test_a_rank_that_returned_without_joining_fails_its_waiting_peer_at_once(
    rank1_first, leave_by_exit
):
    # The rendezvous timeout stays at its default (120 s): only the early return ends it.
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        notebook_launcher(
            rank1_returns_without_joining,
            args=(rank1_first, leave_by_exit),
            num_processes=2,
            live=False,
            backend="cpu",
        )
    assert time.monotonic() - started < PROMPTLY
    error = caught.value
    assert error.rank == 0
    assert "rank 1 has already returned from the launched function without joining" in str(error)
    assert "Every process must create its Accelerator" in str(error)


def test_every_rank_that_joins_late_still_meets_the_others():
    # The waiting rank looks for leavers between short waits; late joiners still meet it.
    assert notebook_launcher(
        rank_joins_after_a_while, num_processes=2, live=False, backend="cpu", return_all=True
    ) == [2, 2]


def rank_joins_after_a_while():
    time.sleep(0.0 if os.environ["RANK"] == "0" else 1.5)
    return Accelerator().num_processes
