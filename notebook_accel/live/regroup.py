"""Bring live workers out of a collective that cannot finish, and form their group again.

When one rank raises (or returns) while its peers wait in a collective for
it, the peers wait until the process group's timeout: 30 minutes by default.
A launch ends every worker, which tears the connections down; live workers
must keep their state, so the kernel instead tells every worker to break its
connections to the others:

- gloo has no way to abort a collective in flight (its `abort()` does
  nothing), but a wait on a connection that is shut down fails at once
  ("Connection closed by peer"). Each worker shuts down its TCP connections
  to the other workers of the group (the store the group met at is in the
  kernel, or in the agent of rank 0's node on a cluster, so it stays up).
  This runs on the thread that reads the worker's calls, while the code the
  user called may be stuck in C++.
- A backend that can abort its communicators itself (nccl) is aborted too.

After that, the old process group is unusable on every rank, and the
kernel asks every worker to `form_again`: leave it and make a new one over
the same store (under a fresh prefix, so no key of an earlier group is read),
with the same backend, ranks and timeout. DDP models wrapped for the old group
are moved to the new one (`DistributedDataParallel._update_process_group`,
made for elastic training), so a prepared model trains on in the next call.
FSDP has no such way: an FSDP model keeps the old group, and the kernel says
it must be prepared again. So does a group made with `new_group` (it is gone
with the old default group).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

# How long each worker waits at the store for the others to start forming the group again.
MEET_SECONDS = 30.0


def break_connections(peer_addresses: list[tuple[str, int]]) -> int:
    """Make every collective this process waits in (or starts) fail at once; return how
    many connections were shut down. `peer_addresses` are the local addresses of the
    group's connections (the kernel gathers them: on a cluster each node's agent sees
    its own worker's). Safe on any thread."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.group.WORLD.abort()  # nccl aborts its communicators; gloo does nothing
    theirs = {tuple(address) for address in peer_addresses}
    mine = psutil.Process().net_connections(kind="tcp")
    # A connection to another worker has that worker's local end as its far end.
    shut = 0
    for connection in mine:
        if connection.raddr and tuple(connection.raddr) in theirs and connection.fd >= 0:
            shut += _shut_down(connection.fd)
    return shut


def _shut_down(fd: int) -> int:
    # shutdown() acts on the connection, not on this descriptor: a duplicate
    # is shut down and closed, and the socket's owner keeps its own descriptor.
    try:
        duplicate = socket.socket(fileno=os.dup(fd))
    except OSError:
        return 0  # closed meanwhile
    with duplicate:
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:
            return 0
    return 1


def form_again(generation: int) -> dict[str, Any]:
    """Leave the broken default process group and form a new one with the same ranks;
    move the DDP models that used the old one. Returns how many models were moved, and
    the FSDP models that cannot be (they keep the old group: they must be prepared again)."""
    old = dist.group.WORLD
    backend = dist.get_backend(old)
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = _timeout(old)
    base = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    store = dist.PrefixStore(f"notebook_accel/formed_again/{generation}/", base)
    # Meet first with a short wait: gloo would wait for a missing peer the whole timeout.
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{peer}" for peer in range(world)], timedelta(seconds=MEET_SECONDS))
    options = {"timeout": timeout} if timeout else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)
    moved, sharded = _move_models(old, dist.group.WORLD)
    return {"ddp_models_moved": moved, "fsdp_models": sharded}


def _timeout(group: dist.ProcessGroup) -> timedelta | None:
    for device in group._device_types:
        with contextlib.suppress(Exception):
            return group._get_backend(device).options._timeout
    return None


def _move_models(old: dist.ProcessGroup, new: dist.ProcessGroup) -> tuple[int, list[str]]:
    """Move the DDP models from `old` to `new`; name the FSDP models, which cannot move."""
    from torch.nn.parallel import DistributedDataParallel

    # Every object of the process, compared by exact type: isinstance() on each of
    # them takes several times as long (a model can be held anywhere).
    ddp = _with_subclasses(DistributedDataParallel)
    fsdp = _fsdp_kinds()
    moved, sharded = 0, []
    for thing in gc.get_objects():
        kind = type(thing)
        if kind in ddp and thing.process_group is old:
            thing._update_process_group(new)
            moved += 1
        elif kind in fsdp:
            sharded.append(thing)
    return moved, _outermost(sharded)


def _fsdp_kinds() -> set[type]:
    """FSDP's module classes, if FSDP was ever imported here (else there is no FSDP model)."""
    package = sys.modules.get("torch.distributed.fsdp")
    kinds: set[type] = set()
    for name in ("FSDPModule", "FullyShardedDataParallel"):  # FSDP2, FSDP1
        kind = getattr(package, name, None)
        if isinstance(kind, type):
            kinds |= _with_subclasses(kind)
    return kinds


def _outermost(modules: list[Any]) -> list[str]:
    """The class names of the modules that are not inside another one of them."""
    inside = {id(child) for module in modules for child in module.modules() if child is not module}
    return sorted({type(module).__name__ for module in modules if id(module) not in inside})


def _with_subclasses(kind: type) -> set[type]:
    found = {kind}
    for subclass in kind.__subclasses__():
        found |= _with_subclasses(subclass)
    return found
