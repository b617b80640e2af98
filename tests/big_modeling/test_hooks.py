"""Hooks undo what they did: offload, remove, offload again, dispatch again, and the
weights are bit-identical to the start (device, dtype, class, requires_grad, ties)."""

from __future__ import annotations

import logging

import pytest
import torch
from big_models import TinyLM
from torch import nn

from notebook_accel.big_modeling import (
    align_module_device,
    attach_align_device_hook,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    find_tied_parameters,
    get_state_dict_offloaded_model,
    has_offloaded_params,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

MIXED_MAP = {
    "embed": "cpu",
    "blocks.0": "disk",
    "blocks.1": "disk",
    "blocks.2": "cpu",
    "blocks.3": "disk",
    "head": "cpu",
    "scale": "disk",
    "spare": "disk",
}


class Frozen(nn.Parameter):
    """A parameter subclass, to check the class survives offloading."""


def _model() -> TinyLM:
    """TinyLM with bfloat16 and float64 tensors, a frozen weight, a Parameter subclass and
    a tied head."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    model.scale = model.scale.double().fill_(0.75)
    model.spare = nn.Linear(3, 3, dtype=torch.bfloat16)  # not used by the forward
    model.blocks[2].up.weight.requires_grad_(False)
    model.blocks[3].down.bias = Frozen(model.blocks[3].down.bias.detach().clone())
    return model


def _snapshot(model: nn.Module) -> dict:
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        name: (t.detach().clone(), t.device, t.dtype, type(t), t.requires_grad)
        for name, t in tensors.items()
    }


def _assert_as_at_start(model: TinyLM, start: dict) -> None:
    now = _snapshot(model)
    assert now.keys() == start.keys()
    for name, (value, *kind) in start.items():
        assert now[name][1:] == tuple(kind), name
        assert torch.equal(now[name][0], value), name  # bit-identical
    assert model.head.weight is model.embed.weight  # tied again


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))


def _run(model: TinyLM) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids())


@pytest.fixture
def expected() -> torch.Tensor:
    return _run(_model())


def test_offload_remove_offload_again_dispatch_again(expected, tmp_path):
    model = _model()
    start = _snapshot(model)
    steps = [
        lambda m: cpu_offload(m),
        lambda m: cpu_offload(m, offload_buffers=True),
        lambda m: disk_offload(m, tmp_path / "a"),
        lambda m: disk_offload(m, tmp_path / "b", offload_buffers=True),
        lambda m: dispatch_model(m, MIXED_MAP, offload_dir=tmp_path / "c"),
        lambda m: dispatch_model(m, dict.fromkeys(MIXED_MAP, "disk"), offload_dir=tmp_path / "d"),
        lambda m: dispatch_model(m, MIXED_MAP, offload_dir=tmp_path / "c", offload_buffers=True),
    ]
    for step in steps:
        step(model)
        assert model.blocks[0].up.weight.device.type == "meta"
        torch.testing.assert_close(_run(model), expected)
        remove_hook_from_submodules(model)
        _assert_as_at_start(model, start)
        torch.testing.assert_close(_run(model), expected)  # a plain model again


def test_offloading_a_hooked_model_again_starts_from_the_model_as_it_was(expected):
    model = _model()
    start = _snapshot(model)
    cpu_offload(model)
    cpu_offload(model, offload_buffers=True)
    torch.testing.assert_close(_run(model), expected)
    remove_hook_from_submodules(model)
    _assert_as_at_start(model, start)


def test_tied_weights_stay_tied_while_offloaded_and_after():
    model = cpu_offload(_model())
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    remove_hook_from_submodules(model)
    assert model.head.weight is model.embed.weight


def test_removing_one_hook_puts_back_that_module_only():
    model = cpu_offload(_model())
    remove_hook_from_module(model.blocks[0].up)
    assert model.blocks[0].up.weight.device.type == "cpu"
    assert model.blocks[0].down.weight.device.type == "meta"
    assert not has_offloaded_params(model.blocks[0].up)
    assert has_offloaded_params(model.blocks[0].down)


def test_a_model_with_offloaded_weights_cannot_be_moved_until_its_hooks_go(tmp_path, caplog):
    model = dispatch_model(_model(), MIXED_MAP, offload_dir=tmp_path)
    with pytest.raises(RuntimeError, match="remove_hook_from_submodules"):
        model.to("cpu")
    remove_hook_from_submodules(model)
    assert model.to("cpu") is model and "to" not in model.__dict__
    model = dispatch_model(_model(), {"": "cpu"}, force_hooks=True)  # hooked, nothing offloaded
    with caplog.at_level(logging.WARNING):
        model.to(torch.float32)  # a dtype only: nothing said
        assert not caplog.records
        model.to("cpu")
    assert "dispatch_model" in caplog.text


def test_align_module_device_brings_offloaded_weights_in_for_the_block(tmp_path):
    model = disk_offload(_model(), tmp_path)
    up = model.blocks[0].up
    with align_module_device(up):
        assert up.weight.device.type == "cpu" and model.blocks[0].down.weight.device.type == "meta"
    assert up.weight.device.type == "meta"
    with align_module_device(up, "cpu"):
        assert up.weight.device.type == "cpu"
    plain = nn.Linear(2, 2)
    with align_module_device(plain, "cpu"):  # not offloaded: its own parameters move
        assert plain.weight.device.type == "cpu"


@pytest.mark.parametrize("preload", [None, ["Block"]])
def test_state_dict_of_an_offloaded_model_is_the_model_s(preload, tmp_path):
    reference = _model()
    want = reference.state_dict()
    for offload in (
        lambda m: cpu_offload(m, preload_module_classes=preload),
        lambda m: disk_offload(m, tmp_path / str(preload), preload_module_classes=preload),
        lambda m: dispatch_model(
            m, MIXED_MAP, offload_dir=tmp_path / "map", preload_module_classes=preload
        ),
    ):
        state = get_state_dict_offloaded_model(offload(_model()))
        assert list(state) == list(want)
        for name, value in want.items():
            assert state[name].device.type == "cpu" and torch.equal(state[name], value), name


def test_cpu_offload_with_hook_moves_the_model_in_and_the_previous_one_out():
    first, second = nn.Linear(4, 4), nn.Linear(4, 2)
    first, hook_1 = cpu_offload_with_hook(first, execution_device="cpu")
    second, hook_2 = cpu_offload_with_hook(second, execution_device="cpu", prev_module_hook=hook_1)
    offloaded = []
    hook_1.offload = lambda: offloaded.append("first")  # what a GPU run would do
    x = torch.randn(3, 4)
    hidden = first(x)
    assert offloaded == []
    torch.testing.assert_close(second(hidden), hidden @ second.weight.T + second.bias)
    assert offloaded == ["first"]
    hook_2.remove()
    second(hidden)
    assert offloaded == ["first"]  # the hook is gone


def test_attach_align_device_hook_offloads_or_aligns_and_is_removed_cleanly(expected):
    model = _model()
    start = _snapshot(model)
    attach_align_device_hook(model, execution_device="cpu")
    assert not has_offloaded_params(model)
    assert not any(t.device.type == "meta" for t in model.parameters())
    torch.testing.assert_close(_run(model), expected)
    remove_hook_from_submodules(model)

    attach_align_device_hook(model, execution_device="cpu", offload=True)
    assert has_offloaded_params(model.blocks[0].up) and model.blocks[0].up.weight.is_meta
    torch.testing.assert_close(_run(model), expected)
    remove_hook_from_submodules(model)
    _assert_as_at_start(model, start)


def test_attach_align_device_hook_reads_a_submodule_s_weights_from_the_model_s_map(expected):
    model = _model()
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    block = model.blocks[1]
    block.up.weight.data.zero_()  # what runs must come from the map, not from the module
    attach_align_device_hook(
        block, "cpu", offload=True, weights_map=weights, module_name="blocks.1"
    )
    torch.testing.assert_close(_run(model), expected)
    remove_hook_from_submodules(block)
    torch.testing.assert_close(block.up.weight, weights["blocks.1.up.weight"])  # read back


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_save_model_of_an_offloaded_model_writes_its_weights(safe_serialization, tmp_path):
    from notebook_accel import Accelerator, load_checkpoint_and_dispatch

    accelerator = Accelerator(cpu=True)
    model, want = _model(), _model().state_dict()
    dispatch_model(model, MIXED_MAP, offload_dir=tmp_path)  # the folder is the offload folder
    assert accelerator.get_state_dict(model).keys() == want.keys()
    accelerator.save_model(model, tmp_path, safe_serialization=safe_serialization)
    fresh = _model()
    for parameter in fresh.parameters():
        parameter.data.zero_()
    # the folder holds the offloaded tensors' files too: the whole-model file is read
    load_checkpoint_and_dispatch(fresh, tmp_path)
    for name, value in want.items():
        assert torch.equal(fresh.state_dict()[name], value), name
