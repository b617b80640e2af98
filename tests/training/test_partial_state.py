"""PartialState, AcceleratorState and notebook_accel.utils: in the kernel and in workers."""

from __future__ import annotations

import pickle

import pytest
import torch

from notebook_accel import (
    Accelerator,
    AcceleratorState,
    GradientAccumulationPlugin,
    PartialState,
    notebook_launcher,
)


class RowsDataset:
    """Stands in for a `datasets.Dataset`: a length and `select(indices)`."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, indices: list[int]) -> RowsDataset:
        return RowsDataset([self.rows[i] for i in indices])


def test_partial_state_in_the_kernel_is_one_process_with_everything():
    state = PartialState()
    assert (state.process_index, state.num_processes, state.is_main_process) == (0, 1, True)
    assert PartialState().__dict__ is state.__dict__  # one shared state
    assert "Num processes: 1" in repr(state)
    with state.split_between_processes([1, 2, 3], apply_padding=True) as mine:
        assert mine == [1, 2, 3]
    state.wait_for_everyone()


def test_reset_state_makes_an_old_accelerator_say_what_happened():
    accelerator = Accelerator()
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError, match=r"_reset_state\(\)` was called"):
        accelerator.prepare(torch.nn.Linear(1, 1))
    assert Accelerator().num_processes == 1  # a new one works


def test_an_accelerator_pickles_with_its_state():
    accelerator = Accelerator()
    accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    copy = pickle.loads(pickle.dumps(accelerator))
    assert copy.state.__dict__ == accelerator.state.__dict__


def test_gradient_accumulation_plugin_sets_the_steps():
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert accelerator.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match="not both"):
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3),
        )


def _shares(apply_padding):
    from notebook_accel.utils import gather_object

    state = PartialState()
    out = {}
    with state.split_between_processes(list(range(5)), apply_padding=apply_padding) as mine:
        out["list"] = mine
    with state.split_between_processes(torch.arange(10).view(5, 2), apply_padding) as mine:
        out["tensor"] = mine.tolist()
    data = {"a": list("abcde"), "b": torch.arange(5)}
    with state.split_between_processes(data, apply_padding=apply_padding) as mine:
        out["dict"] = (mine["a"], mine["b"].tolist())
    with state.split_between_processes(RowsDataset(list("vwxyz")), apply_padding) as mine:
        out["dataset"] = mine.rows
    out["gathered"] = gather_object(out["list"])
    return out


@pytest.mark.parametrize("apply_padding", [False, True])
def test_split_between_processes_in_two_workers(apply_padding):
    rank0, rank1 = notebook_launcher(
        _shares, args=(apply_padding,), num_processes=2, backend="cpu", return_all=True
    )
    assert rank0["list"] == [0, 1, 2] and rank0["dataset"] == list("vwx")
    assert rank0["tensor"] == [[0, 1], [2, 3], [4, 5]]
    assert rank0["dict"] == (list("abc"), [0, 1, 2])
    if apply_padding:  # the short share repeats the last item
        assert rank1["list"] == [3, 4, 4] and rank1["dataset"] == list("yzz")
        assert rank1["tensor"] == [[6, 7], [8, 9], [8, 9]]
        assert rank1["gathered"][:5] == [0, 1, 2, 3, 4]
    else:
        assert rank1["list"] == [3, 4] and rank1["dataset"] == list("yz")
        assert rank1["dict"] == (list("de"), [3, 4])
        assert rank1["gathered"] == [0, 1, 2, 3, 4]


def _utils_in_a_worker():
    from notebook_accel.utils import (
        DistributedOperationException,
        broadcast,
        reduce,
        send_to_device,
        synchronize_rng_states,
    )

    state = PartialState()
    torch.manual_seed(state.process_index)
    synchronize_rng_states(["torch"])
    same = torch.equal(broadcast(torch.get_rng_state()), torch.get_rng_state())
    state.debug = True
    try:
        reduce(torch.zeros(state.process_index + 1))
        refused = False
    except DistributedOperationException:
        refused = True
    finally:
        state.debug = False
    moved = send_to_device({"x": torch.ones(1), "keep": [1]}, "cpu")
    return same, refused, moved["keep"]


def test_functional_utils_in_two_workers():
    assert notebook_launcher(_utils_in_a_worker, num_processes=2, backend="cpu") == (
        True,
        True,
        [1],
    )
