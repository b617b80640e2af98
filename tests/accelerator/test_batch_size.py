"""find_executable_batch_size: 0.9 times the batch on out-of-memory (as Accelerate), free the
failed try's memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from notebook_accel.utils import find_executable_batch_size, should_reduce_batch_size


class Held:
    """Stands for the tensors a try holds when it runs out of memory."""


def test_shrinks_on_torch_out_of_memory_and_frees_the_failed_try_between_tries():
    tried, alive_at_start = [], []
    previous: list[weakref.ref] = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        # what the failed try held is gone: its frames went with its error
        alive_at_start.append([ref() is not None for ref in previous])
        held = Held()
        previous.append(weakref.ref(held))
        tried.append(batch_size)
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size * scale

    gc.disable()  # only the decorator's own collection may free them
    try:
        assert train(10) == 400
    finally:
        gc.enable()
    assert tried == [64, 57, 51, 45, 40]  # int(0.9 * size) each time
    assert alive_at_start[1:] == [[False] * n for n in range(1, 5)]


def test_the_allocators_messages_count_and_other_errors_pass_through():
    assert should_reduce_batch_size(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert should_reduce_batch_size(RuntimeError("CPU out of memory."))
    assert should_reduce_batch_size(RuntimeError("XPU out of memory. Tried to allocate 1 GiB"))
    assert should_reduce_batch_size(RuntimeError("CUDA error: out of memory"))
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("CUDA out of memory."))

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        broken()


def test_gives_up_below_one_and_refuses_a_batch_size_passed_by_hand():
    tried = []

    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        tried.append(batch_size)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 1 TB")

    with pytest.raises(RuntimeError, match="reached zero. Even a batch of 1 ran out of memory"):
        never_fits()
    assert tried == [4, 3, 2, 1]
    with pytest.raises(TypeError, match="gets its batch size as its first argument"):
        never_fits(32)


def test_a_custom_reduction():
    tried = []
    sizes = iter([48, 24])

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 24:
            raise torch.OutOfMemoryError("out of memory")
        return batch_size

    assert train() == 24
    assert tried == [64, 48, 24]


def test_a_starting_batch_size_of_zero_fails_when_called_not_when_decorated():
    @find_executable_batch_size(starting_batch_size=0)
    def train(batch_size):
        raise AssertionError("never called with no batch")

    with pytest.raises(RuntimeError, match="reached zero. Give .* a starting_batch_size of 1"):
        train()
    with pytest.raises(ValueError, match="starting_batch_size=-1 must be 1 or more"):
        find_executable_batch_size(starting_batch_size=-1)(train)
