"""Named tensors of a model: listing them, moving one, tying them, sizing buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel.big_modeling import (
    compute_module_total_buffer_size,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)


class Scaled(nn.Module):
    """A linear layer with a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("mask", torch.ones(2))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def _two_level() -> nn.Module:
    model = nn.Module()
    model.register_buffer("cache", torch.zeros(4))  # persistent here, same last name below
    model.inner = Scaled()
    return model


def test_named_module_tensors_lists_parameters_then_buffers():
    model = _two_level()
    assert [n for n, _ in named_module_tensors(model)] == ["cache"]
    assert [n for n, _ in named_module_tensors(model.inner)] == ["mask", "cache"]
    assert [n for n, _ in named_module_tensors(model, recurse=True)] == [
        "inner.linear.weight",
        "inner.linear.bias",
        "cache",
        "inner.mask",
        "inner.cache",
    ]
    assert [n for n, _ in named_module_tensors(model, include_buffers=False, recurse=True)] == [
        "inner.linear.weight",
        "inner.linear.bias",
    ]
    # Non-persistent buffers are told by their full name: the top "cache" is kept.
    kept = [n for n, _ in named_module_tensors(model, recurse=True, remove_non_persistent=True)]
    assert kept == ["inner.linear.weight", "inner.linear.bias", "cache", "inner.mask"]
    assert set(kept) == set(model.state_dict())


def test_get_non_persistent_buffers_returns_a_new_set_and_changes_nothing():
    model = _two_level()
    assert get_non_persistent_buffers(model) == set()
    found = get_non_persistent_buffers(model, recurse=True)
    assert found == {"cache"} and found is not model.inner._non_persistent_buffers_set
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"inner.cache"}
    found.add("other")
    assert model._non_persistent_buffers_set == set()
    assert model.inner._non_persistent_buffers_set == {"cache"}
    assert "cache" in model.state_dict()


def test_retie_parameters_ties_each_group_to_its_first_real_member():
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    model[0].weight = nn.Parameter(model[0].weight.detach().to("meta"))
    retie_parameters(model, [["0.weight", "1.weight", "3.weight"], ["0.bias", "2.bias"]])
    assert model[0].weight is model[1].weight is model[3].weight
    assert model[1].weight.device.type == "cpu"
    assert model[0].bias is model[2].bias
    with init_meta() as meta:
        retie_parameters(meta, [["0.weight", "1.weight"]])  # all on meta: left as it is
        assert meta[0].weight is not meta[1].weight


def init_meta():
    from notebook_accel.big_modeling import init_empty_weights

    class Built:
        def __enter__(self):
            with init_empty_weights():
                return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

        def __exit__(self, *exc):
            return False

    return Built()


def test_set_module_tensor_to_device_checks_and_keeps_what_it_can():
    model = nn.Sequential(nn.Linear(3, 4))
    weight = model[0].weight
    set_module_tensor_to_device(model, "0.weight", "cpu")
    assert model[0].weight is weight  # nothing to do: the same parameter
    with pytest.raises(ValueError) as error:
        set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.zeros(2, 2))
    assert str(error.value) == (
        'Trying to set a tensor of shape torch.Size([2, 2]) in "weight" (which has shape '
        "torch.Size([4, 3])), this looks incorrect."
    )
    with pytest.raises(ValueError, match="no parameter or buffer named 'wieght'"):
        set_module_tensor_to_device(model, "0.wieght", "cpu")
    set_module_tensor_to_device(model, "0.weight", "meta")
    with pytest.raises(ValueError, match="meta device"):
        set_module_tensor_to_device(model, "0.weight", "cpu")
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(4, 3, dtype=torch.int64))
    assert model[0].weight.dtype == torch.float32  # cast to the model's dtype
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(4, 3), dtype="float16")
    assert model[0].weight.dtype == torch.float16 and model[0].weight.requires_grad


def test_compute_module_total_buffer_size_counts_buffers_only():
    model = _two_level()
    assert compute_module_total_buffer_size(model) == 4 * 4 + 2 * 4 + 2 * 4
    model.half()
    assert compute_module_total_buffer_size(model) == (4 + 2 + 2) * 2
    assert compute_module_total_buffer_size(nn.Linear(2, 2)) == 0


def test_get_module_size_with_ties_adds_the_modules_holding_tied_tensors():
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
    for layer in layers[1:]:
        layer.weight = layers[0].weight
    sizes = {"": 0}
    for index in range(12):
        sizes |= {f"{index}": 80, f"{index}.weight": 64, f"{index}.bias": 16}
    queue = list(layers.named_children())[1:]
    tied = sorted(f"{i}.weight" for i in range(1, 12))  # "1", "10", "11", "2", ...
    size, names, modules = get_module_size_with_ties(tied, 80, sizes, queue)
    assert size == 80 + 11 * 16  # each holder's bias; the tied weight counted once
    assert names == sorted(str(i) for i in range(1, 12))  # "1" never taken for "10"
    assert modules == [layers[int(name)] for name in names]
    assert get_module_size_with_ties([], 80, sizes, queue) == (80, [], [])
