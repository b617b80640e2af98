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
are moved to the new one (`move_ddp`), so a prepared model trains on in the
next call. FSDP has no such way: an FSDP model keeps the old group, and the
kernel says it must be prepared again. So does a group made with `new_group`
(it is gone with the old default group).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import socket
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from notebook_accel.internals import c10d, ddp
from notebook_accel.training import ddp_teardown

# How long each worker waits at the store for the others to start forming the group again.
MEET_SECONDS = 30.0


def break_connections(peer_addresses: list[tuple[str, int]]) -> int:
    """Make every collective this process waits in (or starts) fail at once; return how
    many connections were shut down. `peer_addresses` are the local addresses of the
    group's connections (the kernel gathers them: on a cluster each node's agent sees
    its own worker's). Safe on any thread."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            # nccl aborts its communicators; gloo's abort() does nothing (torch 2.13;
            # tests/live/test_ddp_private_api.py fails on a release where it does more).
            dist.group.WORLD.abort()
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
    timeout = c10d.group_timeout(old)
    base = c10d.default_store()
    dist.destroy_process_group()
    store = dist.PrefixStore(f"notebook_accel/formed_again/{generation}/", base)
    # Meet first with a short wait: gloo would wait for a missing peer the whole timeout.
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{peer}" for peer in range(world)], timedelta(seconds=MEET_SECONDS))
    options = {"timeout": timeout} if timeout else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)
    moved, sharded = _move_models(old, dist.group.WORLD)
    return {"ddp_models_moved": moved, "fsdp_models": sharded}


def _move_models(old: dist.ProcessGroup, new: dist.ProcessGroup) -> tuple[int, list[str]]:
    """Move the DDP models from `old` to `new`; name the FSDP models, which cannot move."""
    # Every object of the process, compared by exact type: isinstance() on each of
    # them takes several times as long (a model can be held anywhere).
    ddp = _with_subclasses(DistributedDataParallel)
    fsdp = _fsdp_kinds()
    moved, sharded = 0, []
    for thing in gc.get_objects():
        kind = type(thing)
        if kind in ddp and thing.process_group is old and move_ddp(thing, new):
            moved += 1
        elif kind in fsdp:
            sharded.append(thing)
    return moved, _outermost(sharded)


# -- moving a DDP model ---------------------------------------------------------------
#
# DDP has no public way to change a model's process group. Its private
# `_update_process_group` does it without a collective (notebook_accel/internals/ddp.py);
# where it is missing, raises, or leaves the model on its old group, the wrapper is
# built again around the same module on the new group.

_warned_rebuild = False

# DDP's arguments that are kept as attributes of the same name (the ones a torch
# release lacks are left out).
_SETTINGS = (
    "device_ids",
    "output_device",
    "dim",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)
# The hooks nn.Module.__init__ empties: those on the wrapper itself (the user's) are kept.
_MODULE_HOOKS = tuple(name for name in vars(torch.nn.Module()) if "hook" in name)


def move_ddp(model: DistributedDataParallel, new: dist.ProcessGroup) -> bool:
    """Make the DDP `model` all-reduce over `new` from its next backward on, keeping its
    module, settings and communication hooks. Returns False (with a warning) if it stays
    on its old group: it must be prepared again."""
    if ddp.update_process_group(model, new):
        ddp_teardown.free_group_after_reducer(model)
        return True
    why_not = _cannot_rebuild(model)
    if why_not:
        warnings.warn(
            f"torch {torch.__version__}'s DistributedDataParallel._update_process_group "
            f"(private) did not move a {type(model).__name__} model to the new process group, "
            f"and it cannot be built again (it {why_not}): it keeps the old group and fails "
            "at its next collective; prepare it again.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    _warn_rebuild_once()
    _rebuild(model, new)
    ddp_teardown.free_group_after_reducer(model)
    return True


def _warn_rebuild_once() -> None:
    global _warned_rebuild
    if not _warned_rebuild:
        _warned_rebuild = True
        warnings.warn(
            f"torch {torch.__version__}'s DistributedDataParallel._update_process_group "
            "(private) did not move a model to the new process group, so its DDP wrapper "
            "was built again around the same module (same settings, same hooks).",
            RuntimeWarning,
            stacklevel=3,
        )


def _cannot_rebuild(model: DistributedDataParallel) -> str | None:
    """Why building `model` again would not give the same wrapper, if it would not
    (each of these registers hooks on the module or its parameters a second time)."""
    if getattr(model, "mixed_precision", None) is not None:
        return "uses DDP's own mixed_precision"
    if ddp.delays_all_reduce(model):
        return "delays the all-reduce of some parameters"
    if getattr(model, "device_mesh", None) is not None:
        return "was made for a device mesh"
    return None


def _rebuild(model: DistributedDataParallel, new: dist.ProcessGroup) -> None:
    """Build the DDP wrapper `model` again around its module, on `new`, with the settings
    and communication hooks it had. In place: every holder of the model (the user's names,
    the Accelerator's list, a compiled wrapper, a hook's weak reference) keeps working."""
    settings = _settings(model)
    hooks, lost = _comm_hooks(model, new)
    kept = {name: value for name, value in vars(model).items() if name in _MODULE_HOOKS and value}
    training = model.training
    ddp.remove_gradient_hooks(model)
    DistributedDataParallel.__init__(model, model.module, process_group=new, **settings)
    vars(model).update(kept)
    model.training = training
    for hook, state in hooks:
        model.register_comm_hook(state, hook)
    if lost:
        warnings.warn(
            f"a {type(model).__name__} model was moved to the new process group without its "
            f"communication hook ({', '.join(lost)}): it cannot be registered again here "
            "(it uses the old group, or is one of DDP's built-in hooks). Its gradients are "
            "all-reduced as without a hook; register the hook again to use it.",
            RuntimeWarning,
            stacklevel=3,
        )


def _settings(model: DistributedDataParallel) -> dict[str, Any]:
    """DDP's arguments that rebuild `model` as it was, without a collective."""
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    settings = {name: getattr(model, name) for name in _SETTINGS if hasattr(model, name)}
    # broadcast_buffers is deprecated for forward_sync_buffers (torch 2.13).
    buffers = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
    settings[buffers] = getattr(model, "forward_sync_buffers", model.broadcast_buffers)
    if not getattr(model, "bucket_bytes_cap_default", True):  # the user set bucket_cap_mb
        settings["bucket_cap_mb"] = model.bucket_bytes_cap / 2**20
    per_bucket = ddp.per_bucket_caps(model)
    if per_bucket:
        settings["bucket_cap_mb_list"] = [cap / 2**20 for cap in per_bucket]
    # The replicas are in step already, and a collective here would have to come in the
    # same order on every rank (gc.get_objects() does not promise one).
    settings["init_sync"] = False
    return {name: value for name, value in settings.items() if name in accepted}


def _comm_hooks(
    model: DistributedDataParallel, new: dist.ProcessGroup
) -> tuple[list[tuple[Callable, Any]], list[str]]:
    """The communication hooks to register on the rebuilt `model` (comm_hooks.register's
    use the current default group, or their state's), and the names of those that cannot
    be: a state that holds another group, or a built-in hook (DDP does not list those)."""
    hooks, lost = [], []
    for hook, state in ddp.comm_hooks(model):
        group = state if isinstance(state, dist.ProcessGroup) else None
        group = getattr(state, "process_group", group)
        if group is None or group is new:
            hooks.append((hook, state))
        else:
            lost.append(getattr(hook, "__qualname__", repr(hook)))
    named = ddp.builtin_comm_hook(model)
    if named and not hooks and not lost:
        lost.append(named)
    return hooks, lost


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
