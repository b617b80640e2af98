"""DDP's gradient buckets across a resume, so that a resumed run sums gradients as the
uninterrupted one did.

DDP all-reduces gradients in flat buckets. A new `DistributedDataParallel` puts every
parameter in one bucket, in the order the module lists them; after its first synced
step it rebuilds the buckets in the order gradients became ready (reversed, for most
models), and keeps them. With three processes or more, where a value sits in a bucket
decides the order in which the collective adds the processes' values for it (a ring
all-reduce starts each chunk at another rank), and float addition is not associative:
the resumed run's first step, made by a new DDP in its first layout, came out about
1e-8 away from the uninterrupted run's, made in the rebuilt one. (With two processes
a + b = b + a: no difference.)

So a checkpoint records the layout its DDP had (`bucket_layout`), and a resumed run
whose new DDP has another layout sums its first step in the saved one
(`sum_first_step_in`): a communication hook all-reduces, for that step only, the
buckets of the saved layout, the same values in the same places as the saved run's
DDP would. DDP then rebuilds its own buckets from that step, as the saved run's did,
and the hook passes every later bucket on to the plain all-reduce. Reading and
settling the layout uses DDP's private reducer (notebook_accel/internals/ddp.py);
tests/checkpoint fail on a torch release where it no longer does this (resume
bit-identical at 3 and 4 processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from notebook_accel.internals import ddp as ddp_internals
from notebook_accel.training.compile import unwrap_compiled

# Below this many processes every layout sums alike (a + b == b + a).
ORDER_MATTERS_FROM = 3

Layout = list[list[str]]  # the buckets, each its parameters' names in bucket order


def ddp_of(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel wrapper of a prepared model (under torch.compile too)."""
    model = unwrap_compiled(model)
    return model if isinstance(model, DistributedDataParallel) else None


def bucket_layout(model: torch.nn.Module) -> Layout | None:
    """The buckets `model`'s DDP reduces gradients in from its next step on (None when
    the model is not wrapped in DDP). A rebuild DDP would make at its next forward is
    made now, so that the layout read is the one the next step uses."""
    ddp = ddp_of(model)
    buckets = None if ddp is None else ddp_internals.bucket_parameters(ddp)
    if buckets is None:
        return None  # a torch without them: resumes as DDP alone does (the tests say so)
    names = {id(p): name for name, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket] for bucket in buckets]


def sum_first_step_in(model: torch.nn.Module, saved: Layout | None) -> bool:
    """Make `model`'s DDP sum its next synced step in the `saved` layout, when that
    differs from its own and the order can change the sums. Returns whether it will.

    Not done where DDP does not rebuild as above (find_unused_parameters, static_graph)
    or where a communication hook of the run's own (gradient compression) is
    registered: DDP takes one hook.
    """
    ddp = ddp_of(model)
    if ddp is None or saved is None or ddp.find_unused_parameters or ddp.static_graph:
        return False
    if dist.get_world_size(ddp.process_group) < ORDER_MATTERS_FROM or ddp_internals.comm_hooks(ddp):
        return False
    if bucket_layout(model) == saved:
        return False
    ddp.register_comm_hook(None, FirstStepInLayout(ddp, saved).hook)
    return True


class FirstStepInLayout:
    """A DDP communication hook (`hook`): the first synced step's buckets are all-reduced as the
    buckets of `layout` (each part divided by the world size first, as DDP does); every
    later bucket as DDP's own all-reduce does it."""

    def __init__(self, ddp: DistributedDataParallel, layout: Layout) -> None:
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.names = {id(p): name for name, p in ddp.module.named_parameters()}
        self.layout = layout
        self.first_step = True

    # Unannotated: DDP compares the annotations with dist.GradBucket and Future at run
    # time, and postponed annotations are strings.
    def hook(self, state, bucket):
        buffer = bucket.buffer()
        if not self.first_step:
            buffer.mul_(1.0 / self.world)  # DDP's own scaling: by the reciprocal
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            return work.get_future().then(lambda done: done.value()[0])
        self._reduce_in_layout(bucket)
        if bucket.is_last():
            self.first_step = False
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _reduce_in_layout(self, bucket: dist.GradBucket) -> None:
        gradients = {
            self.names[id(p)]: g
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
        }
        parts = [part for part in self.layout if part and set(part) <= gradients.keys()]
        covered = {name for part in parts for name in part}
        rest = [name for name in gradients if name not in covered]  # none, as DDP lays out
        for part in [*parts, rest] if rest else parts:
            self._all_reduce([gradients[name] for name in part])

    def _all_reduce(self, views: list[torch.Tensor]) -> None:
        """All-reduce `views` as one flat bucket of them, in order, and write them back."""
        flat = torch.cat([view.reshape(-1) for view in views])
        flat.mul_(1.0 / self.world)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for view in views:
            view.copy_(flat[offset : offset + view.numel()].view_as(view))
            offset += view.numel()
