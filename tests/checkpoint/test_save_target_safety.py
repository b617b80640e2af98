"""save_state never deletes what is not a checkpoint, and survives a kill mid-swap."""

from __future__ import annotations

import os

import pytest
import torch

from notebook_accel import Accelerator, CheckpointError


def prepared():
    accelerator = Accelerator()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator, *accelerator.prepare(model, optimizer)


def test_a_directory_holding_other_files_is_refused_and_kept(tmp_path):
    (tmp_path / "my_notes.txt").write_text("keep me")
    accelerator, _, _ = prepared()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        accelerator.save_state(tmp_path)
    assert (tmp_path / "my_notes.txt").read_text() == "keep me"


def test_the_current_directory_with_a_notebook_is_refused(tmp_path, monkeypatch):
    (tmp_path / "notebook.ipynb").write_text("{}")
    monkeypatch.chdir(tmp_path)
    accelerator, _, _ = prepared()
    with pytest.raises(CheckpointError, match="new or empty directory"):
        accelerator.save_state(".")
    assert (tmp_path / "notebook.ipynb").exists()


def test_saving_again_replaces_a_checkpoint_and_an_empty_directory_is_fine(tmp_path):
    target = tmp_path / "state"
    target.mkdir()
    accelerator, model, _ = prepared()
    accelerator.save_state(target)
    with torch.no_grad():
        model.weight.add_(1.0)
    accelerator.save_state(target)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(target)
    assert torch.equal(model.weight, saved)


def test_a_checkpoint_moved_aside_by_a_killed_save_is_put_back(tmp_path):
    target = tmp_path / "state"
    accelerator, model, _ = prepared()
    accelerator.save_state(target)
    saved = model.weight.detach().clone()
    os.rename(target, tmp_path / ".state.previous")  # killed between the two renames
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(target)
    assert torch.equal(model.weight, saved)
    assert target.is_dir() and not (tmp_path / ".state.previous").exists()
