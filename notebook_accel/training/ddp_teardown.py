"""A DDP model freed after its process group was left must not hang the process.

`destroy_process_group()` drops torch's own reference to the group; a DDP model
made on it still holds one, in C++, through its reducer. When that model is
freed (the training function returns after `end_training()`), the reducer is
freed with the GIL held, and if it held the group's last reference,
`~ProcessGroupGloo` joins the group's worker threads with the GIL still held. A
worker thread that has just run the last collective (the barrier before
leaving) may be releasing it right then: that work holds tensors Python also
knew, and freeing them takes the GIL. Neither thread moves again. It happened in
about one run in twelve of a function that leaves the group and returns (the
stacks: pytorch/pytorch#56297, destructors bound through pybind11 that block
while holding the GIL).

The Python object of a process group frees it with the GIL released
(torch binds `ProcessGroup` so). So each DDP model keeps its group's Python
object in its last attribute: Python frees a module's attributes in the order
they were set, the reducer and its logger first, then this one, which then
holds the group's last reference and frees it without the GIL. A copy or a
pickle of the model holds no group there (DDP's own pickling drops its group and
reducer alike).

`prepare()` does it for the models it wraps. A launched worker does it for every DDP
model made in it (`hold_every_models_group_after_its_reducer`), so a function that
builds its own (torch's tutorial: `init_process_group`, `DistributedDataParallel`,
`destroy_process_group()`, return) ends too: it hung 2 launches in 60 before.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.nn.parallel import DistributedDataParallel

_ATTRIBUTE = "_process_group_freed_last"
_WRAPPED = "_notebook_accel_frees_group_last"


class _GroupHeld:
    """A process group, held; copied or pickled, it holds none."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __reduce__(self) -> tuple:
        return (_GroupHeld, ())


def free_group_after_reducer(model: DistributedDataParallel) -> None:
    """Make `model`'s process group outlive its reducer (call again after the model
    moves to another group: the attribute is set anew, last)."""
    attributes = vars(model)
    attributes.pop(_ATTRIBUTE, None)
    attributes[_ATTRIBUTE] = _GroupHeld(model.process_group)


def frees_group_after_reducer(model: DistributedDataParallel) -> bool:
    """Whether `model`'s group is held after its reducer and logger, by its own group."""
    names = list(vars(model))
    held = vars(model).get(_ATTRIBUTE)
    if held is None or held.group is not model.process_group:
        return False
    held_in_cpp = [names.index(name) for name in ("reducer", "logger") if name in names]
    return all(index < names.index(_ATTRIBUTE) for index in held_in_cpp)


def hold_every_models_group_after_its_reducer() -> None:
    """In this process (a launched worker), make every DDP model made from now on free
    its group after its reducer, however the user made it (once per process)."""
    init = DistributedDataParallel.__init__
    if getattr(init, _WRAPPED, False):
        return

    @functools.wraps(init)
    def __init__(model: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        init(model, *args, **kwargs)
        free_group_after_reducer(model)

    setattr(__init__, _WRAPPED, True)
    DistributedDataParallel.__init__ = __init__
