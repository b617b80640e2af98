"""A function that leaves the process group and returns with its DDP model alive (what
a script's `end_training()` does) ends on every rank, every time (ddp_teardown.py).

Without the model holding its group last, about one launch in twelve of this function
hung a rank in `~ProcessGroupGloo` (freed by the DDP reducer with the GIL held) while
its worker thread waited for the GIL: 4 of the first 35 launches of a loop. A DDP
model the function makes itself, as torch's tutorial does, hung 18 launches in 80.

Each launch checks the cause itself (every rank's model frees its group last), so the
loop is sized to catch the hang coming back, not to find it: 20 launches of each miss a
1-in-12 hang with odds of 1 in 6, and the suite runs them on three torch versions
(tests/torch_range), missing it on all three with odds under 1 in 100.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from notebook_accel import notebook_launcher

pytestmark = pytest.mark.timeout(300)

LAUNCHES = 20


def leave_the_group_then_return() -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.training import ddp_teardown

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    for _ in range(2):
        accelerator.backward(model(torch.randn(8, 4)).sum())
    # The last collective before leaving holds tensors Python knows (a gather's).
    gathered = accelerator.gather(torch.arange(3) + accelerator.process_index)
    held_last = ddp_teardown.frees_group_after_reducer(model)
    accelerator.state.destroy_process_group()  # as end_training() does in a script
    return {"gathered": gathered.tolist(), "held_last": held_last}
    # `model` is freed here, after the group was left


def train_as_torch_tutorial_does() -> dict:
    """torch's own DDP, made without `prepare()`: a worker holds its group last too."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from notebook_accel.training import ddp_teardown

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(gathered, torch.arange(3) + dist.get_rank())
    held_last = ddp_teardown.frees_group_after_reducer(model)
    dist.destroy_process_group()
    return {"gathered": torch.cat(gathered).tolist(), "held_last": held_last}


@pytest.mark.parametrize(
    "function",
    [leave_the_group_then_return, train_as_torch_tutorial_does],
    ids=["prepared", "users_own_ddp"],
)
def test_a_model_freed_after_the_group_was_left_never_hangs_a_rank(function):
    for launch in range(LAUNCHES):
        results = notebook_launcher(
            function,
            num_processes=2,
            backend="cpu",
            timeout=60,
            output="none",
            return_all=True,
        )
        assert results == [{"gathered": [0, 1, 2, 1, 2, 3], "held_last": True}] * 2, launch


def test_the_group_outlives_the_reducer_in_a_model_freed_by_python():
    """In one process: the group's Python object is the model's last attribute; freed in
    order, the reducer lets go of the group before it. Only launched workers hold every
    model's group so: here (the launching process) a model made by hand does not."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from notebook_accel.training import ddp_teardown

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        assert not ddp_teardown.frees_group_after_reducer(model)
        ddp_teardown.free_group_after_reducer(model)
        assert ddp_teardown.frees_group_after_reducer(model)
        names = list(vars(model))
        assert max(names.index("reducer"), names.index("logger")) < len(names) - 1
        ddp_teardown.free_group_after_reducer(model)  # again: still one, still last
        assert list(vars(model))[-1] == "_process_group_freed_last"
        assert list(vars(model)).count("_process_group_freed_last") == 1
        # A copy holds no group (DDP's pickling drops its group and reducer too).
        copied = pickle.loads(pickle.dumps(model))
        assert copied._process_group_freed_last.group is None
        assert torch.equal(copied.module.weight, model.module.weight)
    finally:
        dist.destroy_process_group()
