"""Checkpoint files in one process: naming, rotation, bad input, the scaler, save_model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    CheckpointError,
    ProjectConfiguration,
    load_model_weights,
    notebook_launcher,
)
from notebook_accel.checkpoint.training_state import list_checkpoints, parse_size


def _model(width=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )


def _prepared(project=None, **config):
    accelerator = Accelerator(
        project_config=ProjectConfiguration(project_dir=project and str(project), **config)
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return accelerator, *accelerator.prepare(model, optimizer)


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


# -- automatic naming and rotation --------------------------------------------------------


def test_automatic_naming_keeps_total_limit_and_load_state_takes_the_newest(tmp_path):
    accelerator, model, _ = _prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    for _ in range(4):
        with torch.no_grad():
            model[0].bias += 1
        accelerator.save_state()
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["checkpoint_2", "checkpoint_3"]
    newest = _weights(model)

    accelerator, model, _ = _prepared(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    assert accelerator.load_state().endswith("checkpoint_3")
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), newest, strict=True))
    assert accelerator.project_configuration.iteration == 4  # the next save continues the count
    assert accelerator.save_state().endswith("checkpoint_4")


def test_an_existing_automatic_checkpoint_is_not_overwritten(tmp_path):
    accelerator, *_ = _prepared(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    accelerator.project_configuration.iteration = 0
    with pytest.raises(FileExistsError, match="Call load_state"):
        accelerator.save_state()


def test_half_written_and_unfinished_directories_are_not_listed(tmp_path):
    accelerator, *_ = _prepared(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    folder = tmp_path / "checkpoints"
    (folder / ".checkpoint_1.partial").mkdir()
    (folder / "checkpoint_7").mkdir()  # no checkpoint.json: never completed
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint_0"]
    assert accelerator.load_state().endswith("checkpoint_0")


def test_saving_to_the_same_directory_replaces_it_whole(tmp_path):
    accelerator, model, _ = _prepared()
    accelerator.save_state(tmp_path / "ckpt")
    with torch.no_grad():
        model[0].bias += 1
    expected = _weights(model)
    accelerator.save_state(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left beside it
    with torch.no_grad():
        model[0].bias -= 5
    accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), expected, strict=True))


# -- bad input ------------------------------------------------------------------------------


def test_a_missing_directory_is_named(tmp_path):
    accelerator, *_ = _prepared()
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        accelerator.load_state(tmp_path / "nowhere")


def test_a_project_without_checkpoints_says_so(tmp_path):
    accelerator, *_ = _prepared(tmp_path, automatic_checkpoint_naming=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        accelerator.load_state()


def test_a_directory_without_manifest_is_not_a_checkpoint(tmp_path):
    accelerator, *_ = _prepared()
    with pytest.raises(CheckpointError, match="not a complete checkpoint: checkpoint.json"):
        accelerator.load_state(tmp_path)


def test_a_damaged_weights_file_is_named_and_nothing_changes(tmp_path):
    accelerator, model, optimizer = _prepared()
    accelerator.save_state(tmp_path)
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[:8] = b"\xff" * 8  # same size, unreadable header
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with torch.no_grad():
        model[0].bias += 1
    before = _weights(model)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupted"):
        accelerator.load_state(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), before, strict=True))


def test_a_different_set_of_objects_is_refused(tmp_path):
    accelerator, *_ = _prepared()
    accelerator.save_state(tmp_path)
    other = Accelerator()
    other.prepare(_model())
    with pytest.raises(CheckpointError, match="holds 1 optimizers, but this Accelerator has 0"):
        other.load_state(tmp_path)


def test_register_for_checkpointing_needs_state_dict_methods():
    with pytest.raises(ValueError, match=r"state_dict\(\) and load_state_dict\(\)"):
        Accelerator().register_for_checkpointing(object())


def test_saving_in_the_middle_of_accumulation_warns(tmp_path):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    with accelerator.accumulate(), pytest.warns(UserWarning, match="middle of gradient"):
        accelerator.save_state(tmp_path)


# -- what is saved --------------------------------------------------------------------------


def test_the_fp16_loss_scale_is_restored(tmp_path):
    accelerator = Accelerator(mixed_precision="fp16")
    accelerator.scaler.scale(torch.ones(()))  # the scale tensor is made on first use
    accelerator.scaler.update(new_scale=1024.0)
    accelerator.save_state(tmp_path)
    accelerator.scaler.update(new_scale=8.0)
    accelerator.load_state(tmp_path)
    assert accelerator.scaler.get_scale() == 1024.0


def test_skip_first_batches_of_a_plain_dataloader():
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    skipped = Accelerator().skip_first_batches(loader, 3)
    assert len(skipped) == 2
    assert [batch.tolist() for (batch,) in skipped] == [[6, 7], [8, 9]]


def test_skip_first_batches_of_a_prepared_dataloader():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    skipped = accelerator.skip_first_batches(loader, 3)
    assert len(skipped) == 2
    assert [batch.tolist() for (batch,) in skipped] == [[6, 7], [8, 9]]
    assert [batch.tolist() for (batch,) in loader][0] == [0, 1]  # the next pass is whole


# -- save_model -----------------------------------------------------------------------------


def test_sharded_weights_round_trip_through_the_index(tmp_path):
    model = _model(width=64)
    Accelerator().save_model(model, tmp_path, max_shard_size="1KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # 0.weight (1024 bytes) alone, then 0.bias, 2.weight and 2.bias (776 bytes)
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert index["metadata"]["total_size"] == sum(p.nbytes for p in model.parameters())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    load_model_weights(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(model), strict=True))


def test_a_smaller_save_removes_the_shards_of_a_larger_one(tmp_path):
    model = _model(width=64)
    Accelerator().save_model(model, tmp_path, max_shard_size="1KB")
    Accelerator().save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    Accelerator().save_model(model, tmp_path, safe_serialization=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "pytorch_model.bin"]


def test_pickled_weights_round_trip(tmp_path):
    model = _model()
    Accelerator().save_model(model, tmp_path, max_shard_size=200, safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin.index.json").is_file()
    fresh = load_model_weights(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
        tmp_path,
    )
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(model), strict=True))


def test_tied_weights_are_saved_once_and_restored(tmp_path):
    def tied():
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
        model[1].weight = model[0].weight
        return model

    model = tied()
    Accelerator().save_model(model, tmp_path)
    fresh = load_model_weights(tied(), tmp_path)
    assert torch.equal(fresh[1].weight, model[0].weight)
    assert fresh[1].weight is fresh[0].weight


def test_weights_of_another_shape_are_refused_with_the_names(tmp_path):
    Accelerator().save_model(_model(), tmp_path)
    with pytest.raises(CheckpointError, match=r"0\.weight has shape \[8, 4\] in the file"):
        load_model_weights(_model(width=16), tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_model_weights(_model(), tmp_path / "nowhere")


def test_shard_sizes_read_like_hugging_face():
    assert parse_size("10GB") == 10 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1kb") == 1000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("ten gigs")


def save_prepared_model(folder):
    accelerator = Accelerator()
    model = accelerator.prepare(_model())
    accelerator.save_model(model, folder, max_shard_size="100B")
    return type(model).__name__


def test_two_workers_save_the_unwrapped_model_once(tmp_path):
    wrappers = notebook_launcher(
        save_prepared_model,
        args=(tmp_path,),
        num_processes=2,
        return_all=True,
        live=False,
        backend="cpu",
    )
    assert wrappers == ["DistributedDataParallel"] * 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    fresh = load_model_weights(_model(width=8).requires_grad_(False), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(_model()), strict=True))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_a_file_whose_bytes_changed_but_not_its_size_is_named(tmp_path, name):
    accelerator, model, optimizer = _prepared()
    accelerator.save_state(tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01  # one bit of the data, well past any header
    path.write_bytes(bytes(data))
    before = _weights(model)
    with pytest.raises(
        CheckpointError, match=rf"{name.replace('.', '[.]')} is corrupted: its checksum"
    ):
        accelerator.load_state(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), before, strict=True))


def test_the_manifest_records_each_file_checksum_as_computed_from_the_file(tmp_path):
    from notebook_accel.checkpoint.checksums import file_checksum

    accelerator, model, optimizer = _prepared()
    accelerator.save_state(tmp_path, safe_serialization=False)
    accelerator.save_state(tmp_path / "safe")
    for folder in (tmp_path, tmp_path / "safe"):
        manifest = json.loads((folder / "checkpoint.json").read_text())
        assert set(manifest["checksums"]) == set(manifest["files"])
        for name, checksum in manifest["checksums"].items():
            assert checksum == file_checksum(folder / name), name


def test_a_checkpoint_saved_before_checksums_still_loads(tmp_path):
    accelerator, model, optimizer = _prepared()
    accelerator.save_state(tmp_path)
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    del manifest["checksums"]
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    accelerator.load_state(tmp_path)


def test_checksums_joined_in_pieces_equal_zlib_over_the_whole():
    import os
    import random
    import zlib

    from notebook_accel.checkpoint.checksums import crc32_combine

    rng = random.Random(7)
    for _ in range(100):
        a, b = os.urandom(rng.randint(0, 200)), os.urandom(rng.randint(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
