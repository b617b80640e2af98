"""Forming the process group has a short timeout of its own."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from notebook_accel import Accelerator, WorkerError, notebook_launcher
from notebook_accel.platforms import joining
from tests_support import PROMPTLY


def launch_store():
    """The launch's store, as a worker reaches it: to wait there for what another rank did."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=PROMPTLY),
    )


def mark(what: str, rank: int) -> str:
    """The store's key for `what` ("joined", "left") of `rank` in this launch."""
    return joining._key(what, rank, joining._attempt())


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
    # Rank 1 leaves either before rank 0 starts to wait (rank 0 waits until the launcher
    # has marked rank 1 as gone) or while it waits (rank 1 waits until rank 0 has joined).
    # A wait that fails raises, and the run fails otherwise than the test expects.
    if os.environ["RANK"] == ("0" if rank1_first else "1"):
        awaited = mark("left", 1) if rank1_first else mark("joined", 0)
        launch_store().wait([awaited])
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


def test_every_rank_that_joins_late_still_meets_the_others(capfd):
    # The waiting rank looks at the store again and again; a late joiner still meets it,
    # and the looking prints nothing (a store wait that times out warns each time).
    assert notebook_launcher(
        rank_joins_after_a_while, num_processes=2, live=False, backend="cpu", return_all=True
    ) == [2, 2]
    output = capfd.readouterr()
    assert "waitForInput" not in output.err + output.out


# How many times rank 0 looks at the store for its late peer before that peer joins.
LOOKS = 20


def rank_joins_after_a_while():
    store = launch_store()
    if os.environ["RANK"] == "0":
        counted = iter(range(1, LOOKS + 1))

        def pause(seconds: float) -> None:  # each pause between two looks
            if next(counted, None) == LOOKS:
                store.set("test/looked", "1")
            time.sleep(seconds)

        # Only in this worker's process: its joining module waits with this clock.
        joining.time = SimpleNamespace(monotonic=time.monotonic, sleep=pause)
    else:
        store.wait(["test/looked"])  # rank 0 has looked LOOKS times
    return Accelerator().num_processes


def test_at_the_store_a_rank_that_joined_then_exited_is_no_leaver_and_one_that_never_joined_is(
    monkeypatch,
):
    import torch.distributed as dist

    from notebook_accel.platforms import joining

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.HashStore()
    for rank in (0, 1):
        store.set(f"notebook_accel/joined/0/{rank}", "1")
    joining.mark_left(store, 1, attempt=0)  # joined, trained, exited: rank 0 still meets it
    assert joining._wait_for_peers(store, rank=0, world=2, waited=5) == []

    joining.mark_left(store, 2, attempt=0)  # exited without joining
    with pytest.raises(RuntimeError, match="rank 2 has already returned"):
        joining._wait_for_peers(store, rank=0, world=3, waited=5)
    # Another attempt's marks are not this one's: rank 1 is only late, and stays missing.
    store = dist.HashStore()
    store.set("notebook_accel/joined/0/0", "1")
    joining.mark_left(store, 1, attempt=1)
    assert joining._wait_for_peers(store, rank=0, world=2, waited=0.3) == [1]
