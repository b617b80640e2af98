"""How a worker joins the others, and how it learns that a peer never will.

The ranks meet at the launch's store (launch/rendezvous.py) before
`init_process_group`: gloo and nccl wait for a missing peer for the whole
collective timeout (30 minutes), the store for a short one. The process that
hosts the store marks each of its workers that exits cleanly (`mark_left`), so
a rank waiting for a peer that returned without ever joining fails at once
with the reason instead of after the wait.
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch.distributed as dist

from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.config.settings import ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_SECONDS

# How often, at most, a rank waiting for its peers looks at the store again. It
# polls: a store wait that times out prints a warning from c10d each time.
_LOOK_AT_MOST_EVERY = 0.1


def join_process_group(process_group_backend: str, kwargs: InitProcessGroupKwargs) -> None:
    """`init_process_group` from the launch's environment, with a short wait to meet."""
    if not dist.is_available():
        raise RuntimeError(
            "This torch build has no torch.distributed; it cannot run several processes."
        )
    if "MASTER_ADDR" not in os.environ and kwargs.init_method is None:
        raise RuntimeError(
            "WORLD_SIZE > 1 but MASTER_ADDR is not set, so this process cannot find the others. "
            "Start the processes with notebook_launcher(...) or torchrun."
        )
    timeout = _timeout(kwargs)
    backend = kwargs.backend or process_group_backend
    if kwargs.init_method not in (None, "env://"):
        dist.init_process_group(
            backend,
            init_method=kwargs.init_method,
            **({"timeout": timeout} if timeout else {}),
        )
        return
    # Meeting the others gets a short timeout of its own: a process that never
    # joins must not leave the rest waiting for the 30-minute collective timeout.
    waited = float(os.environ.get(ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_SECONDS))
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=waited)))
        store.set(_key("joined", rank, _attempt()), "1")
        never_joined = _wait_for_peers(store, rank, world, waited)
        if never_joined:
            ranks = ", ".join(str(peer) for peer in never_joined)
            raise _rendezvous_error(waited, f"rank {ranks} did not join")
        # From here on the store serves the group (nccl reads its communicator id
        # from it at the first collective): give it the group's own timeout.
        store.set_timeout(timeout or dist.default_pg_timeout)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            **({"timeout": timeout} if timeout else {}),
        )
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        raise _rendezvous_error(waited, error) from error
    # Workers started by notebook_launcher leave with os._exit and skip this;
    # under torchrun the interpreter exits normally, and a process group still
    # alive then can abort the process ("terminate called without an active
    # exception") from its threads' destructors.
    atexit.register(_leave_process_group)


def mark_left(store: dist.Store, rank: int, attempt: int) -> None:
    """Record in `store` (hosted by the launching process) that `rank` of launch
    attempt `attempt` has exited cleanly, whether or not it joined."""
    store.set(_key("left", rank, str(attempt)), "1")
    store.add(_key("left", "count", str(attempt)), 1)  # after the key: see _wait_for_peers


def _key(what: str, rank: int | str, attempt: str) -> str:
    # Each attempt of a launch with restarts has a store of its own; the attempt
    # in the key also keeps apart attempts that share one (torchrun's agent store).
    return f"notebook_accel/{what}/{attempt}/{rank}"


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _wait_for_peers(store: dist.Store, rank: int, world: int, waited: float) -> list[int]:
    """Wait until every rank joined and return [], or the ranks still missing after
    `waited` seconds; fail at once if one exited without joining."""
    attempt = _attempt()
    joined = [_key("joined", peer, attempt) for peer in range(world)]
    left_count, seen_leaving = _key("left", "count", attempt), 0
    deadline, pause = time.monotonic() + waited, 0.002
    while not store.check(joined):
        leaving = store.add(left_count, 0)  # reads the count
        if leaving != seen_leaving:
            seen_leaving = leaving
            # A rank joins before it can exit: one that left and, looked at
            # afterwards, has not joined, never will.
            never = [
                peer
                for peer in range(world)
                if store.check([_key("left", peer, attempt)]) and not store.check([joined[peer]])
            ]
            if never:
                raise RuntimeError(_left_without_joining(rank, never))
        if time.monotonic() >= deadline:
            return [peer for peer in range(world) if not store.check([joined[peer]])]
        time.sleep(pause)
        pause = min(pause * 2, _LOOK_AT_MOST_EVERY)
    return []


def _left_without_joining(rank: int, left: list[int]) -> str:
    ranks = ", ".join(str(peer) for peer in left)
    who = f"rank {ranks} has" if len(left) == 1 else f"ranks {ranks} have"
    return (
        f"rank {rank} waits for every process to join the process group, but {who} "
        "already returned from the launched function without joining. Every process "
        "must create its Accelerator (or PartialState): do not return early on some "
        "ranks before creating it."
    )


def _timeout(kwargs: InitProcessGroupKwargs) -> timedelta | None:
    if kwargs.timeout is None:
        return None
    if isinstance(kwargs.timeout, timedelta):
        return kwargs.timeout
    return timedelta(seconds=kwargs.timeout)


def _leave_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            # A barrier first: destroy right after the last collective can hang a rank.
            dist.monitored_barrier(timeout=timedelta(seconds=30))
    except RuntimeError:
        pass  # a peer is gone; leave anyway
    finally:
        dist.destroy_process_group()


def _rendezvous_error(waited: float, error: Exception | str) -> RuntimeError:
    return RuntimeError(
        f"rank {os.environ.get('RANK', '?')} waited {waited:.0f} s for all "
        f"{os.environ.get('WORLD_SIZE', '?')} processes to join and gave up ({error}). "
        "Every process must create its Accelerator (or join the process group); on "
        "several machines, check that every machine was started with the same "
        "master address and port."
    )
