"""The offload folder: tensors kept on disk as safetensors files, read through a memory map.

An `index.json` maps each tensor name to the file and key that hold it. A file may be
one the folder wrote (`<name>.safetensors`) or, when a safetensors checkpoint already
holds the tensor in the dtype wanted, the checkpoint's own shard: nothing is copied.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "index.json"


def offload_weight(
    tensor: torch.Tensor, name: str, folder: str | os.PathLike, index: dict[str, dict]
) -> dict[str, dict]:
    """Write `tensor` to `folder` as `<name>.safetensors` and record it in `index`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    file = f"{name}.safetensors"
    save_file({name: tensor.detach().to("cpu").contiguous()}, str(folder / file))
    index[name] = {"file": file, "key": name}
    return index


def reference_weight(name: str, file: str | os.PathLike, key: str, index: dict[str, dict]) -> None:
    """Record in `index` that `name` is `key` of an existing safetensors `file` (no copy)."""
    index[name] = {"file": str(Path(file).resolve()), "key": key}


def save_offload_index(index: Mapping[str, dict], folder: str | os.PathLike) -> None:
    """Write (merging with what is there) the folder's `index.json`."""
    path = Path(folder) / INDEX
    merged = load_offload_index(folder) if path.exists() else {}
    merged.update(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    os.replace(tmp, path)


def load_offload_index(folder: str | os.PathLike) -> dict[str, dict]:
    """The folder's index (empty when it has none)."""
    path = Path(folder) / INDEX
    return json.loads(path.read_text()) if path.exists() else {}


def offload_state_dict(folder: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of `state_dict` to `folder`, and its index."""
    index: dict[str, dict] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, folder, index)
    save_offload_index(index, folder)


class OffloadedWeightsLoader(Mapping):
    """Tensors by name from a CPU `state_dict` and an offload folder, read on access.

    Files are memory-mapped once and kept open; each access reads one tensor.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, dict] | None = None,
    ) -> None:
        self.state_dict = dict(state_dict or {})
        self.save_folder = Path(save_folder) if save_folder is not None else None
        if index is None and self.save_folder is not None:
            index = load_offload_index(self.save_folder)
        self.index = dict(index or {})
        self._files: dict[str, Any] = {}

    def _path(self, file: str) -> str:
        path = Path(file)
        if not path.is_absolute() and self.save_folder is not None:
            path = self.save_folder / path
        return str(path)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.state_dict:
            return self.state_dict[name]
        entry = self.index.get(name)
        if entry is None:
            raise KeyError(name)
        path = self._path(entry["file"])
        handle = self._files.get(path)
        if handle is None:
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"offloaded tensor {name!r} should be in {path}, which is gone: "
                    "load the model again (the offload folder must outlive the model)"
                )
            handle = self._files[path] = safe_open(path, framework="pt", device="cpu")
        return handle.get_tensor(entry["key"])

    def __iter__(self) -> Iterator[str]:
        yield from self.state_dict
        yield from (name for name in self.index if name not in self.state_dict)

    def __len__(self) -> int:
        return len(set(self.state_dict) | set(self.index))

    def __contains__(self, name: object) -> bool:
        return name in self.state_dict or name in self.index


class PrefixedDataset(Mapping):
    """The entries of `dataset` under `prefix`, by their name inside it."""

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[self.prefix + key]

    def __iter__(self) -> Iterator[str]:
        return (k[len(self.prefix) :] for k in self.dataset if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self.prefix + key) in self.dataset
