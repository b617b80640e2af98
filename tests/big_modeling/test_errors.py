"""Bad input: a clear error naming the tensor or file, and nothing half-loaded left behind."""

from __future__ import annotations

import pytest
import torch
from big_models import TinyLM, save_sharded

from notebook_accel.big_modeling import (
    check_device_map,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from notebook_accel.big_modeling import loading as loading_module
from notebook_accel.platforms.cuda import cuda_device_count

# A GPU index no machine running this has (counted without starting CUDA).
MISSING_GPU = cuda_device_count() + 7


def _empty() -> TinyLM:
    with init_empty_weights():
        return TinyLM()


def _all_meta(model: TinyLM) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    return save_sharded(TinyLM(), tmp_path / "ckpt")


def test_a_missing_shard_is_named_before_anything_loads(checkpoint):
    shard = sorted(checkpoint.parent.glob("*.safetensors"))[-1]
    shard.unlink()
    model = _empty()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint_and_dispatch(model, checkpoint, device_map={"": "cpu"})
    assert _all_meta(model)


def test_a_checkpoint_key_that_matches_nothing_is_named(tmp_path, caplog):
    torch.manual_seed(0)
    source = TinyLM()
    source.register_buffer("stale", torch.zeros(2))
    index = save_sharded(source, tmp_path / "ckpt")
    model = _empty()
    with pytest.raises(ValueError, match="'stale'.*matches no parameter"):
        load_checkpoint_in_model(model, index, strict=True)
    assert _all_meta(model)
    with caplog.at_level("WARNING"):
        load_checkpoint_in_model(model, index)  # by default, as Accelerate: skipped, said
    assert "['stale']" in caplog.text and "were not used when loading TinyLM" in caplog.text
    assert not _all_meta(model)
    assert torch.equal(model.blocks[0].up.weight, source.blocks[0].up.weight)


def test_a_device_map_key_that_matches_nothing_is_named(checkpoint):
    model = _empty()
    device_map = {"": "cpu", "blocks.9": "cpu", "blocks.0.upp": "cpu"}
    with pytest.raises(
        ValueError, match=r"'blocks.9'.*'blocks.0.upp' \(did you mean 'blocks.0.up'"
    ):
        check_device_map(model, device_map, strict=True)
    with pytest.warns(UserWarning, match="'blocks.9'.*they are ignored"):
        load_checkpoint_in_model(model, checkpoint, device_map=device_map)
    assert not _all_meta(model)


def test_max_memory_below_the_largest_layer_names_it(caplog):
    model = _empty()
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    options = dict(max_memory={"cpu": block // 2}, no_split_module_classes=["Block"])
    with pytest.raises(ValueError, match=r"largest layer, 'blocks\.0'"):
        infer_auto_device_map(model, strict=True, **options)
    with caplog.at_level("INFO"):  # by default, as Accelerate: all on disk, and said
        assert infer_auto_device_map(model, **options) == {"": "disk"}
    assert "insufficient memory" in caplog.text and "cpu: " in caplog.text


@pytest.mark.parametrize(
    "device_map,match",
    [
        ({"": "gpu"}, "'gpu' is not a device"),
        (
            {"embed": "cpu", "blocks": f"cuda:{MISSING_GPU}", "head": "cpu", "scale": "cpu"},
            f"names device {MISSING_GPU}",
        ),
    ],
)
def test_an_unknown_device_is_named_and_nothing_loads(checkpoint, device_map, match):
    model = _empty()
    with pytest.raises(ValueError, match=match):
        load_checkpoint_and_dispatch(model, checkpoint, device_map=device_map)
    assert _all_meta(model)
    with pytest.raises(ValueError, match="'tpu'"):
        infer_auto_device_map(model, max_memory={"tpu": "1GB"})


def test_disk_without_an_offload_folder_is_refused_before_loading(checkpoint):
    model = _empty()
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu", "blocks": "disk"})
    assert _all_meta(model)


def test_dispatch_refuses_weights_that_are_nowhere():
    model = _empty()
    with pytest.raises(ValueError, match="meta device and in no state_dict"):
        dispatch_model(
            model,
            {"embed": "cpu", "blocks": "disk", "head": "cpu", "scale": "cpu"},
            offload_dir=None,
            offload_index={},
        )


def test_a_failure_while_loading_puts_loaded_tensors_back_on_meta(checkpoint, monkeypatch):
    real = loading_module.set_module_tensor_to_device
    calls = []

    def failing(model, name, device, value=None, dtype=None):
        if str(device) != "meta":
            calls.append(name)
            if len(calls) == 5:
                raise RuntimeError("out of memory (simulated)")
        return real(model, name, device, value=value, dtype=dtype)

    monkeypatch.setattr(loading_module, "set_module_tensor_to_device", failing)
    model = _empty()
    with pytest.raises(RuntimeError, match="simulated"):
        load_checkpoint_in_model(model, checkpoint)
    assert len(calls) == 5
    assert _all_meta(model)
