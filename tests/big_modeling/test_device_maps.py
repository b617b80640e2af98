"""What infer_auto_device_map and check_device_map say besides the map: the warning that
kept buffers fit on no GPU, the devices left empty, keys that name nothing; and sizes."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from notebook_accel.big_modeling import (
    check_device_map,
    convert_file_size_to_int,
    infer_auto_device_map,
)


def _buffered() -> nn.Module:
    """Three layers of 64, 72 and 100 bytes of parameters, with 80, 128 and 120 of buffers."""
    model = nn.Sequential()
    model.add_module("linear1", nn.Linear(3, 4))
    model.add_module("batchnorm", nn.BatchNorm1d(4))
    model.add_module("linear2", nn.Linear(4, 5))
    model.linear1.register_buffer("extra", torch.zeros(20))
    model.batchnorm.register_buffer("extra", torch.zeros(22))
    model.linear2.register_buffer("extra", torch.zeros(30))
    return model


def _warnings_of(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


def test_buffers_of_offloaded_modules_that_fit_on_no_gpu_are_warned_about():
    model = _buffered()
    device_map, said = _warnings_of(lambda: infer_auto_device_map(model, {0: 400, "cpu": 10**9}))
    assert device_map == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}
    assert len(said) == 1 and "offload_buffers=True" in said[0] and "248 B" in said[0]
    # offloaded with their module: nothing to say
    _, said = _warnings_of(
        lambda: infer_auto_device_map(model, {0: 400, "cpu": 10**9}, offload_buffers=True)
    )
    assert said == []
    # a second GPU with room for them: nothing to say; without the room: said
    _, said = _warnings_of(lambda: infer_auto_device_map(model, {0: 300, 1: 800, "cpu": 10**9}))
    assert said == []
    _, said = _warnings_of(lambda: infer_auto_device_map(model, {"cpu": 400}))
    assert said == []  # no GPU: the buffers are in CPU memory anyway


def test_devices_left_empty_are_logged_as_insufficient_memory(caplog):
    model = nn.Sequential(nn.Linear(10, 4), nn.Linear(4, 4), nn.Linear(4, 8))
    with caplog.at_level(logging.INFO):
        device_map = infer_auto_device_map(model, max_memory={0: 256})
    assert all(device == "disk" for device in device_map.values())
    assert "insufficient memory" in caplog.text and "0: 336 B" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        device_map = infer_auto_device_map(model, max_memory={0: 256}, fallback_allocation=True)
    assert 0 in device_map.values() and "insufficient memory" not in caplog.text


def test_check_device_map_warns_about_keys_that_name_nothing_and_refuses_gaps():
    model = _buffered()
    with pytest.warns(UserWarning, match=r"'linear3' \(did you mean 'linear2'\?\), 'other'"):
        check_device_map(model, {"": "cpu", "linear3": 0, "other": 1})
    with pytest.raises(ValueError, match="'linear3'"):
        check_device_map(model, {"": "cpu", "linear3": 0}, strict=True)
    with pytest.raises(ValueError, match="puts 'batchnorm.weight' nowhere"):
        check_device_map(model, {"linear1": 0, "linear2": 0})
    model.linear1.register_buffer("scratch", torch.zeros(2), persistent=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # tensor keys are fine; a non-persistent buffer needs no entry
        check_device_map(
            model,
            {
                "linear1.weight": 0,
                "linear1.bias": 0,
                "linear1.extra": 0,
                "batchnorm": "cpu",
                "linear2": "cpu",
            },
        )


@pytest.mark.parametrize(
    "size,expected",
    [(500, 500), ("0MB", 0), ("1.5GB", 1_500_000_000), ("2GiB", 2 * 2**30), ("8Mb", 10**6)],
)
def test_convert_file_size_to_int(size, expected):
    assert convert_file_size_to_int(size) == expected


@pytest.mark.parametrize("size", ["-1GB", -1, "5MBB", "5k0MB", "12", "GB"])
def test_convert_file_size_to_int_refuses_what_is_no_size(size):
    with pytest.raises(ValueError):
        convert_file_size_to_int(size)
