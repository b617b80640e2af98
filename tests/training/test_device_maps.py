"""prepare() and models a device map placed: dispatched ones stay put, quantized ones
are checked before training (as Accelerate checks them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel import Accelerator
from notebook_accel.platforms import probes
from notebook_accel.training import device_maps


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)

    def forward(self, x):
        return self.second(self.first(x))


def _quantized(device_map: dict) -> nn.Module:
    model = TwoLayers()
    model.is_loaded_in_8bit = True  # what transformers sets on a bitsandbytes model
    model.hf_device_map = device_map
    return model


@pytest.fixture
def no_cpu_bitsandbytes(monkeypatch):
    monkeypatch.setattr(probes, "is_bitsandbytes_multi_backend_available", lambda: False)


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"first": 0, "second": "disk"}])
def test_a_quantized_model_offloaded_is_refused_saying_how_to_load_it(
    device_map, no_cpu_bitsandbytes
):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"CPU or disk offload.*device_map=\{'': 'cpu'\}"):
        accelerator.prepare_model(_quantized(device_map))


def test_a_quantized_model_on_the_cpu_is_trained_there_when_bitsandbytes_runs_there(
    monkeypatch,
):
    monkeypatch.setattr(probes, "is_bitsandbytes_multi_backend_available", lambda: True)
    model = _quantized({"": "cpu"})
    assert Accelerator(cpu=True).prepare_model(model) is model


def test_a_quantized_model_on_another_device_than_the_process_is_refused():
    with pytest.raises(ValueError, match="different device than the one you're training on"):
        device_maps.check_quantized_placement(
            _quantized({"": 1}), torch.device("cuda", 0), distributed=False
        )
    # the first GPU is accepted by a process whose device has no index, as in Accelerate
    device_maps.check_quantized_placement(
        _quantized({"": 0}), torch.device("cuda"), distributed=False
    )
    device_maps.check_quantized_placement(
        _quantized({"": "cuda:1"}), torch.device("cuda", 1), distributed=False
    )


def test_a_quantized_model_over_several_devices_is_refused_only_when_distributed():
    model = _quantized({"first": 0, "second": 1})
    device_maps.check_quantized_placement(model, torch.device("cuda", 0), distributed=False)
    with pytest.raises(ValueError, match="multiple devices in a distributed run"):
        device_maps.check_quantized_placement(model, torch.device("cuda", 0), distributed=True)


def test_a_dispatched_model_is_left_where_its_map_put_it(tmp_path):
    from notebook_accel.big_modeling import dispatch_model

    model = TwoLayers()
    x = torch.randn(3, 2)
    expected = model(x)
    dispatch_model(
        model, {"first": "cpu", "second": "disk"}, main_device="cpu", offload_dir=tmp_path
    )
    prepared = Accelerator(cpu=True).prepare(model)  # moving it would raise: weights on meta
    assert prepared is model and model.second.weight.device.type == "meta"
    torch.testing.assert_close(prepared(x), expected)
