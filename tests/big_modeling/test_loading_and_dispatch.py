"""Skeletons, checkpoint loading and dispatch, offload, torch.compile: same outputs as the
model in one piece."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from big_models import TinyLM, save_sharded
from safetensors.torch import save_file
from torch import nn

from notebook_accel.big_modeling import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_offload_index,
    load_state_dict,
)
from tests_support import dev_dependency


@pytest.fixture
def reference() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM().eval()
    model.scale.fill_(0.75)  # a buffer the checkpoint must restore
    return model


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))


def _empty() -> TinyLM:
    with init_empty_weights():
        return TinyLM().eval()


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(8))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    assert model[1].running_mean.device.type == "cpu"
    with init_empty_weights(include_buffers=True):
        model = nn.BatchNorm1d(8)
    assert model.running_mean.device.type == "meta"
    with init_on_device("cpu"):
        assert nn.Linear(2, 2).weight.device.type == "cpu"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards


def test_sharded_checkpoint_on_cpu_and_disk_matches(reference, ids, tmp_path):
    index = save_sharded(reference, tmp_path / "ckpt")
    model = _empty()
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    model = load_checkpoint_and_dispatch(
        model,
        index,
        device_map="auto",
        max_memory={"cpu": 3 * block},
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "offload",
    )
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))
    # Offloaded weights stay on the meta device between forwards.
    disk = [name for name, device in model.hf_device_map.items() if device == "disk"]
    assert all(p.device.type == "meta" for p in model.get_submodule(disk[0]).parameters())
    # Same dtype as the checkpoint: the offload index points into the shards, nothing copied.
    entries = load_offload_index(tmp_path / "offload")
    assert entries and all(e["file"].endswith(".safetensors") for e in entries.values())
    assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == ["index.json"]


def test_dtype_conversion_writes_the_offload_folder(reference, ids, tmp_path):
    state = {k: v for k, v in reference.state_dict().items() if k != "head.weight"}  # tied
    save_file(state, str(tmp_path / "model.safetensors"))
    model = _empty()
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk"}
    device_map |= {"blocks.3": "cpu", "head": "cpu", "scale": "cpu"}
    load_checkpoint_in_model(
        model, tmp_path, device_map=device_map, offload_folder=tmp_path / "off", dtype="float16"
    )
    assert model.embed.weight.dtype == torch.float16
    written = sorted(p.name for p in (tmp_path / "off").iterdir())
    assert "blocks.1.up.weight.safetensors" in written
    dispatch_model(model, device_map, offload_dir=tmp_path / "off")
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).float(), reference.half()(ids).float(), atol=1e-2, rtol=1e-2
        )


def test_a_pickled_checkpoint_loads_too(reference, ids, tmp_path):
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    model = _empty()
    load_checkpoint_in_model(model, tmp_path / "pytorch_model.bin")
    assert model.head.weight is model.embed.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))


def test_cpu_offload_and_disk_offload_match(reference, ids, tmp_path):
    with torch.no_grad():
        expected = reference(ids)
    for offload in (cpu_offload, lambda m: disk_offload(m, tmp_path / "disk")):
        torch.manual_seed(0)
        model = TinyLM().eval()
        model.scale.fill_(0.75)
        model = offload(model)
        assert model.blocks[0].up.weight.device.type == "meta"
        with torch.no_grad():
            torch.testing.assert_close(model(ids), expected)
        assert model.blocks[0].up.weight.device.type == "meta"  # released after the forward


def test_weights_are_released_when_a_forward_raises(tmp_path):
    model = disk_offload(nn.Sequential(nn.Linear(4, 4)), tmp_path)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert model[0].weight.device.type == "meta"


@pytest.mark.timeout(300)
def test_offloaded_model_under_torch_compile(reference, ids, tmp_path):
    with torch.no_grad():
        expected = reference(ids)
    torch.manual_seed(0)
    model = TinyLM().eval()
    model.scale.fill_(0.75)
    model = disk_offload(model, tmp_path)
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), expected)
        torch.testing.assert_close(compiled(ids), expected)  # weights released and reloaded


def test_transformers_model_generates_the_same(tmp_path):
    transformers = dev_dependency("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "gpt2", max_shard_size="60KB")
    assert len(list((tmp_path / "gpt2").glob("*.safetensors"))) > 2
    with init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    model.tie_weights()
    sizes = infer_auto_device_map(model, no_split_module_classes=["GPT2Block"])
    assert sizes  # a map from the real free memory
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "gpt2",
        device_map="auto",
        max_memory={"cpu": "80KB"},
        no_split_module_classes=["GPT2Block"],
        offload_folder=tmp_path / "offload",
    ).eval()
    assert "disk" in model.hf_device_map.values()
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=6, do_sample=False)
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_importing_the_package_does_not_load_big_modeling():
    code = (
        "import sys, notebook_accel, notebook_accel.utils as u;"
        "assert 'notebook_accel.big_modeling' not in sys.modules;"
        "f = u.infer_auto_device_map;"
        "assert 'notebook_accel.big_modeling' in sys.modules;"
        "assert f.__module__ == 'notebook_accel.big_modeling.device_map'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_index_without_weight_map_loads_too(reference, ids, tmp_path):
    index = save_sharded(reference, tmp_path / "ckpt")
    flat = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps(flat))  # {tensor: file}, as older tools wrote it
    model = _empty()
    load_checkpoint_in_model(model, tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))


def test_without_a_device_map_each_tensor_stays_where_it_is(reference, tmp_path):
    torch.save(reference.state_dict(), tmp_path / "weights.bin")
    model = TinyLM()
    model.blocks[0] = model.blocks[0].to("meta")
    load_checkpoint_in_model(model, tmp_path / "weights.bin")
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, reference.state_dict()[name])


def test_load_state_dict_reads_a_file_where_the_map_says(reference, tmp_path):
    state = reference.state_dict()
    state.pop("head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    torch.save(state, tmp_path / "m.bin")
    for path, device_map in [
        (tmp_path / "m.safetensors", None),
        (tmp_path / "m.safetensors", {"embed": "cpu", "blocks": "disk"}),  # "disk": the CPU
        (tmp_path / "m.bin", None),
    ]:
        loaded = load_state_dict(str(path), device_map=device_map)
        assert sorted(loaded) == sorted(state)
        for name, value in state.items():
            assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], value), name


def test_dispatching_all_to_disk_runs_on_the_cpu(reference, ids, tmp_path):
    model = TinyLM().eval()
    model.load_state_dict(reference.state_dict())
    device_map = {"embed": "disk", "blocks": "disk", "head": "disk", "scale": "disk"}
    dispatch_model(model, device_map, offload_dir=tmp_path)
    assert all(p.device.type == "meta" for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))
