"""How a worker joins the others, and how it tells them it never will.

The ranks meet at the launch's store (launch/rendezvous.py) before
`init_process_group`: gloo and nccl wait for a missing peer for the whole
collective timeout (30 minutes), the store for a short one. A worker started
by the launcher that returns without ever joining says so at the store, so a
peer that waits for it fails at once with the reason instead of after the wait.
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch.distributed as dist

from notebook_accel.config.kwargs import InitProcessGroupKwargs
from notebook_accel.config.settings import ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_SECONDS

# How often a rank waiting for its peers looks whether one of them left instead.
_LOOK_FOR_LEAVERS_EVERY = timedelta(seconds=0.5)
# A rank that left says so within this, or not at all (the store may be gone).
_SAY_LEFT_WITHIN = timedelta(seconds=10)

# Whether this process joined a group through join_process_group.
_joined = False


def join_process_group(process_group_backend: str, kwargs: InitProcessGroupKwargs) -> None:
    """`init_process_group` from the launch's environment, with a short wait to meet."""
    global _joined
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
        _joined = True
        return
    # Meeting the others gets a short timeout of its own: a process that never
    # joins must not leave the rest waiting for the 30-minute collective timeout.
    waited = float(os.environ.get(ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_SECONDS))
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=waited)))
        store.set(_key("joined", rank), "1")
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
    _joined = True
    # Workers started by notebook_launcher leave with os._exit and skip this;
    # under torchrun the interpreter exits normally, and a process group still
    # alive then can abort the process ("terminate called without an active
    # exception") from its threads' destructors.
    atexit.register(_leave_process_group)


def say_left_without_joining() -> None:
    """Tell the launch's store that this rank returned without joining the group.

    Called by a launched worker after the training function returned. A peer
    waiting in `join_process_group` then fails at once, naming this rank. Does
    nothing where the process joined, runs alone, or the store cannot be reached.
    """
    env = os.environ
    if _joined or (dist.is_available() and dist.is_initialized()):
        return
    if int(env.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in env:
        return
    try:
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=_SAY_LEFT_WITHIN,
            wait_for_workers=False,
        )
        store.set(_key("left", int(env.get("RANK", "0"))), "1")
    except (KeyError, ValueError, RuntimeError):
        pass  # nobody can be waiting for this rank there: the launch has ended


def _key(what: str, rank: int) -> str:
    # Each attempt of a launch with restarts has a store of its own; the attempt
    # in the key also keeps apart attempts that share one (torchrun's agent store).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"notebook_accel/{what}/{attempt}/{rank}"


def _wait_for_peers(store: dist.Store, rank: int, world: int, waited: float) -> list[int]:
    """Wait until every rank joined and return [], or the ranks still missing after
    `waited` seconds; fail at once if one returned without joining."""
    missing = [peer for peer in range(world) if peer != rank]
    deadline = time.monotonic() + waited
    while True:
        left = [peer for peer in missing if store.check([_key("left", peer)])]
        if left:
            raise RuntimeError(_left_without_joining(rank, left))
        missing = [peer for peer in missing if not store.check([_key("joined", peer)])]
        remaining = deadline - time.monotonic()
        if not missing or remaining <= 0:
            return missing
        try:
            store.wait(
                [_key("joined", missing[0])],
                min(_LOOK_FOR_LEAVERS_EVERY, timedelta(seconds=remaining)),
            )
        except dist.DistStoreError:
            pass  # not yet (the store raises this when a wait times out): look again


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
