"""A weight tied between modules (an embedding and the head that reads it) is read from
the offload store once per forward of the model and shared by the modules that use it;
between forwards it is on the meta device again, also after a forward that raised."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from big_models import TinyLM
from torch import nn

from notebook_accel.big_modeling import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    remove_hook_from_submodules,
)
from notebook_accel.big_modeling.offload import OffloadedWeightsLoader

TIED = ("embed.weight", "head.weight")
# The two tied modules offloaded, the blocks between them resident.
TIED_AWAY = {"embed": "disk", "blocks": "cpu", "head": "disk", "scale": "cpu"}

OFFLOADS: dict[str, Callable[[nn.Module, Path], nn.Module]] = {
    "cpu_offload": lambda m, folder: cpu_offload(m),
    "cpu_offload_whole_model_preloaded": lambda m, folder: cpu_offload(
        m, preload_module_classes=["TinyLM"]
    ),
    "disk_offload": lambda m, folder: disk_offload(m, folder),
    "dispatch_to_disk": lambda m, folder: dispatch_model(m, TIED_AWAY, offload_dir=folder),
    "dispatch_from_cpu_state_dict": lambda m, folder: dispatch_model(
        m, TIED_AWAY, state_dict=m.state_dict()
    ),
}


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def _tied_reads(reads: Counter) -> int:
    return sum(reads[name] for name in TIED)


def _tied_on_meta(model: TinyLM) -> bool:
    return model.embed.weight.is_meta and model.head.weight.is_meta


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """How many times each name is read from an offload store (CPU tensors or folder)."""
    counted: Counter = Counter()
    read = OffloadedWeightsLoader.__getitem__

    def counting(self: OffloadedWeightsLoader, name: str) -> torch.Tensor:
        counted[name] += 1
        return read(self, name)

    monkeypatch.setattr(OffloadedWeightsLoader, "__getitem__", counting)
    return counted


@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_one_forward_reads_a_tied_weight_once(offload, reads, tmp_path):
    reference = _model()
    expected = _run(reference, _ids())
    model = OFFLOADS[offload](_model(), tmp_path)
    for _ in range(2):  # the second forward reads it again: nothing stays loaded between
        reads.clear()
        torch.testing.assert_close(_run(model, _ids()), expected)
        assert _tied_reads(reads) == 1, reads
        assert max(reads.values()) == 1, reads  # every offloaded weight once
        assert _tied_on_meta(model)
    remove_hook_from_submodules(model)
    assert model.head.weight is model.embed.weight  # one parameter again
    assert torch.equal(model.embed.weight, reference.embed.weight)


def test_a_tied_module_called_on_its_own_loads_its_weight(reads, tmp_path):
    reference = _model()
    model = disk_offload(_model(), tmp_path)
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model.head(hidden), reference.head(hidden))
        torch.testing.assert_close(model.embed(_ids()), reference.embed(_ids()))
    assert _tied_reads(reads) == 2  # once for each call: no forward of the model shares it
    assert _tied_on_meta(model)


def test_a_forward_that_raises_leaves_the_tied_weight_freed(reads, tmp_path):
    reference = _model()
    model = disk_offload(_model(), tmp_path)
    with pytest.raises(IndexError):
        _run(model, torch.full((1, 2), 99))  # out of the vocabulary: the embedding raises
    assert _tied_reads(reads) == 1
    assert _tied_on_meta(model)
    reads.clear()
    torch.testing.assert_close(_run(model, _ids()), _run(reference, _ids()))
    assert _tied_reads(reads) == 1  # read again: the failed forward kept nothing loaded
