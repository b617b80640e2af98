"""What live regrouping takes from torch that torch does not promise: DDP's private
`_update_process_group` moves a model to a new process group, and gloo's `abort()` does
nothing. These tests fail on the first torch release where that changes; the fallback
(building the DDP wrapper again, live/regroup.py) is checked to give the same training.

Each scenario runs in 2 real gloo processes, and the old group is broken as the kernel
breaks it (each rank shuts down its connections to the other): a model still on it
fails its next all-reduce at once, so a step that works went through the new group.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from notebook_accel import WorkerError
from notebook_accel.accelerator import comm_hooks
from notebook_accel.config.kwargs import DistributedDataParallelKwargs
from notebook_accel.launch.forking import heap_frozen
from notebook_accel.live import regroup, start_workers
from notebook_accel.training import ddp_teardown

pytestmark = pytest.mark.timeout(120)

WORLD = 2
TIMEOUT = timedelta(seconds=30)  # a hang fails the scenario long before the test's timeout
# Not DDP's defaults, to see that a rebuilt wrapper keeps them.
SETTINGS = {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "find_unused_parameters": True}
KEPT = ("bucket_bytes_cap", "gradient_as_bucket_view", "find_unused_parameters", "static_graph")


# -- running a scenario on 2 processes ------------------------------------------------


def on_two_ranks(scenario: Callable[..., dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
    """Run `scenario(rank, store, *args)` in 2 forked processes; return each rank's result.
    The store is here, as the kernel's is (launch/rendezvous.py), so breaking the ranks'
    connections to each other leaves it up; like the kernel's, it starts serving after
    the fork (a thread running during a fork can leave a lock held in the child).
    Like the launcher's workers, the ranks never collect this process's garbage: an
    earlier test's DDP model left in a reference cycle holds its gloo group, whose
    destructor joins threads a fork does not copy (both ranks hung in it)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with heap_frozen():
            context = mp.start_processes(
                _run, args=(port, scenario, args), nprocs=WORLD, join=False, start_method="fork"
            )
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=TIMEOUT,
                master_listen_fd=os.dup(listener.fileno()),
            )
            while not context.join(timeout=1):
                pass
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
    return [pickle.loads(store.get(f"result/{rank}")) for rank in range(WORLD)]


def _run(rank: int, port: int, scenario: Callable[..., dict[str, Any]], args: tuple) -> None:
    # As a launched worker does: a test before this one may have run a parallel op in this
    # process, and a forked child's first parallel op then crashes or waits on the
    # parent's OpenMP threads, gone here (libgomp is not fork-safe).
    torch.set_num_threads(1)
    # A rank that hangs shows where, and ends, long before the test's own limit.
    faulthandler.dump_traceback_later(3 * TIMEOUT.total_seconds(), exit=True)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("old/", store), rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    try:
        result = scenario(rank, store, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    store.set(f"result/{rank}", pickle.dumps(result))


def break_and_form_again(rank: int, store: dist.Store) -> dist.ProcessGroup:
    """Break the default group's connections as the kernel does (live/regroup.py), and form
    a new default group over the same store, as `regroup.form_again` does."""
    # The connections between the ranks, not those to the store.
    mine = [
        tuple(c.laddr)
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and store.port not in (c.laddr.port, c.raddr.port)
    ]
    store.set(f"addresses/{rank}", pickle.dumps(mine))
    store.wait([f"addresses/{1 - rank}"], TIMEOUT)  # both ranks are past their last step
    # (The rank that comes second may find its end closed already: gloo closes it.)
    regroup.break_connections(pickle.loads(store.get(f"addresses/{1 - rank}")))
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("new/", store), rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    # A rank whose scenario never uses the new group leaves it as it returns; gloo's
    # connect of a peer still waiting to see the connection made then fails on its end
    # closed ("Connection closed by peer"). Neither leaves before both have formed it.
    store.set(f"formed/{rank}", "1")
    store.wait([f"formed/{1 - rank}"], TIMEOUT)
    return dist.group.WORLD


# -- the scenario: train, break the group, move the model, train on ---------------------


def batches() -> list[torch.Tensor]:
    return [torch.randn(8, 4, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]


def new_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def backward(model: torch.nn.Module, data: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(data).square().mean().backward()


def moved_by_torch(model: DistributedDataParallel, new: dist.ProcessGroup) -> None:
    model._update_process_group(new)  # what regroup relies on, called as torch has it


def moved_by_regroup(sabotage: str) -> Callable[[DistributedDataParallel, Any], None]:
    """`regroup.move_ddp`, with DDP's private method gone, raising, or doing nothing."""

    def move(model: DistributedDataParallel, new: dist.ProcessGroup) -> None:
        if sabotage == "missing":
            del DistributedDataParallel._update_process_group  # this process ends after
        elif sabotage == "raises":
            DistributedDataParallel._update_process_group = _raises
        elif sabotage == "does nothing":
            DistributedDataParallel._update_process_group = lambda self, group: None
        assert regroup.move_ddp(model, new)

    return move


def _raises(self: DistributedDataParallel, group: dist.ProcessGroup) -> None:
    raise TypeError("_update_process_group() takes 1 positional argument but 2 were given")


def train_across_a_broken_group(
    rank: int, store: dist.Store, move: Callable | None, hook: str | None = None
) -> dict[str, Any]:
    """One step on the old group, then the group is broken and formed again, `move` moves
    the model (None: it stays), and one step more: its gradients, or the step's error."""
    module = new_module()
    model = DistributedDataParallel(module, **SETTINGS)
    # As prepare() and launched workers do: a model freed after its group was left
    # must free the group after its reducer, or this rank can hang as the scenario
    # returns (ddp_teardown.py; it hung a model left on the broken group here).
    ddp_teardown.free_group_after_reducer(model)
    if hook:
        comm_hooks.register(model, DistributedDataParallelKwargs(comm_hook=hook))
    if hook == "fp16":  # and one whose state holds the old group: it cannot follow
        other = DistributedDataParallel(new_module())
        ddp_teardown.free_group_after_reducer(other)
        other.register_comm_hook(dist.group.WORLD, _allreduce_on)
    parameters = list(model.parameters())
    data = batches()
    backward(model, data[rank])
    settings = {name: getattr(model, name) for name in KEPT}
    calls = []
    model.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    model.eval()  # the wrapper's flag alone: a rebuilt wrapper keeps it
    new = break_and_form_again(rank, store)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        if move is not None:
            move(model, new)
            if hook == "fp16":
                regroup.move_ddp(other, new)
    result = {
        "warnings": [str(w.message) for w in warned],
        "on_new_group": model.process_group is new,
        "kept": settings == {name: getattr(model, name) for name in KEPT}
        and not model.training
        and list(model.parameters()) == parameters,
        "hooks": [hook.__qualname__ for hook, _ in getattr(model, "_comm_hooks", [])],
        "frees_group_last": ddp_teardown.frees_group_after_reducer(model),
    }
    model.train()
    try:
        backward(model, data[rank])
    except RuntimeError as error:
        return {**result, "error": str(error)}
    result["hook_called"] = len(calls) == 1
    result["grads"] = [p.grad.clone() for p in module.parameters()]
    # What DDP's average must be: the gradient of the same loss over both batches.
    reference = new_module()
    backward(reference, torch.cat(data))
    result["expected"] = [p.grad for p in reference.parameters()]
    return result


def _allreduce_on(group, bucket):  # DDP checks a hook's annotations by identity: none here
    tensor = bucket.buffer().div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: tensor)


def assert_averaged(results: list[dict[str, Any]], atol: float = 1e-6) -> None:
    for result in results:
        assert "error" not in result, result["error"]
        assert result["on_new_group"]
        for grad, expected in zip(result["grads"], result["expected"], strict=True):
            torch.testing.assert_close(grad, expected, atol=atol, rtol=0)
    for grad, other in zip(results[0]["grads"], results[1]["grads"], strict=True):
        assert torch.equal(grad, other)


@pytest.fixture(scope="module")
def moved_by_torch_results() -> list[dict[str, Any]]:
    return on_two_ranks(train_across_a_broken_group, moved_by_torch)


# -- what torch does ---------------------------------------------------------------------


def test_update_process_group_moves_the_all_reduce_to_the_new_group(moved_by_torch_results):
    """If this fails, DDP's private `_update_process_group` no longer does what
    live/regroup.py relies on: regroup then builds DDP wrappers again (and warns)."""
    assert_averaged(moved_by_torch_results)
    assert all(result["warnings"] == [] for result in moved_by_torch_results)


def test_a_model_left_on_the_broken_group_fails_its_next_step():
    # What makes the test above mean something: the old group cannot all-reduce any more.
    results = on_two_ranks(train_across_a_broken_group, None)
    assert all("error" in result and not result["on_new_group"] for result in results)


def test_gloos_abort_does_nothing_and_the_group_is_destroyed_after_it():
    """regroup breaks the connections itself because gloo's `abort()` does nothing (torch
    2.13). If this fails because a collective fails after `abort()`, gloo can abort now:
    breaking the connections may no longer be needed, and `form_again` must still be able
    to destroy an aborted group (checked here too)."""
    results = on_two_ranks(abort_then_reduce)
    assert results == [{"abort": "returned", "after": 2.0, "destroyed": True}] * WORLD


def abort_then_reduce(rank: int, store: dist.Store) -> dict[str, Any]:
    try:
        dist.group.WORLD.abort()
        aborted = "returned"
    except Exception as error:  # noqa: BLE001 - what it raises is the finding
        aborted = f"{type(error).__name__}: {error}"
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {"abort": aborted, "after": total.item(), "destroyed": not dist.is_initialized()}


# -- the fallback -----------------------------------------------------------------------


@pytest.mark.parametrize("sabotage", ["missing", "raises", "does nothing"])
def test_a_rebuilt_wrapper_trains_on_the_new_group_as_a_moved_one(sabotage, moved_by_torch_results):
    results = on_two_ranks(train_across_a_broken_group, moved_by_regroup(sabotage))
    assert_averaged(results)
    for result, moved in zip(results, moved_by_torch_results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(result["grads"], moved["grads"], strict=True))
        assert result["kept"] and result["hook_called"]
        assert result["frees_group_last"]  # the new group, held after the new reducer
        [warning] = result["warnings"]
        assert "_update_process_group" in warning and torch.__version__ in warning
        assert "built again around the same module" in warning


def test_a_model_regroup_moves_holds_its_new_group_after_its_reducer():
    """A moved model can be freed after the new group is left (ddp_teardown.py)."""
    results = on_two_ranks(train_across_a_broken_group, moved_by_regroup("nothing"))
    assert_averaged(results)
    assert all(result["frees_group_last"] for result in results)


def test_a_rebuilt_wrapper_keeps_its_comm_hook_and_names_one_it_cannot_keep():
    results = on_two_ranks(train_across_a_broken_group, moved_by_regroup("missing"), "fp16")
    assert_averaged(results, atol=1e-2)  # fp16-compressed gradients
    for result in results:
        assert result["hooks"] == ["fp16_compress_hook"]
        rebuilt, lost = result["warnings"]
        assert "built again" in rebuilt
        assert "without its communication hook (_allreduce_on)" in lost


# -- in live workers ---------------------------------------------------------------------

DDP_CELL = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from notebook_accel import Accelerator
from notebook_accel.live import regroup

torch.manual_seed(0)
accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(16, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
del DistributedDataParallel._update_process_group  # as if a torch release dropped it

def train_step():
    loss = model(data).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

def fail_while_the_other_reduces():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up before the all-reduce")
    train_step()  # rank 0 waits in DDP's all-reduce
"""

REBUILT = """(
    regroup._warned_rebuild,
    accelerator._models[0] is model,
    model.process_group is dist.group.WORLD,
    accelerator.unwrap_model(model).weight.detach(),
)"""


def test_live_workers_rebuild_a_prepared_model_that_torch_cannot_move():
    with start_workers(2, backend="cpu", live=False) as workers:
        workers.run_cell(DDP_CELL)
        workers.run_cell("train_step()")
        with pytest.raises(WorkerError, match="rank 1 gave up") as failure:
            workers.run_cell("fail_while_the_other_reduces()", timeout=60)
        assert "process group was formed again" in str(failure.value)
        workers.run_cell("train_step()")  # over the new group: the old one is broken
        answers = workers.run_cell(REBUILT, return_all=True)
        assert [answer[:3] for answer in answers] == [(True, True, True)] * 2
        assert torch.equal(answers[0][3], answers[1][3])  # the replicas agree
