"""What the per-file checksums cost a save_state and a load_state of a large checkpoint.

A model of `--gb` GB of float32 weights (and a plain SGD optimizer) is saved
with `save_state` in this process, alternately with and without checksums,
`--repeats` times each; then loaded likewise. Printed: the median seconds of
each and the checksums' share of the save and of the load.

    python bench/checkpoint_checksum.py [--gb 1] [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from notebook_accel import Accelerator
from notebook_accel.checkpoint import training_state as checkpoint_module


class _PlainFile:
    """A file as before checksums: writes pass straight through."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        return self._file.write(data)

    def flush(self):
        self._file.flush()

    def checksum(self):
        return None

    def close(self):
        pass


@contextlib.contextmanager
def checksums_off():
    """save_state and load_state as before checksums: none computed, none checked."""
    replaced = {
        "ChecksummingFile": _PlainFile,
        "tensor_checksums": lambda tensors: {},
        "safetensors_checksum": lambda path, sums: None,
        "file_checksum": lambda path: "crc32:00000000",
        "_check_files": lambda folder, files, checksums: None,
    }
    original = {name: getattr(checkpoint_module, name) for name in replaced}
    for name, stand_in in replaced.items():
        setattr(checkpoint_module, name, stand_in)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(checkpoint_module, name, value)


def timed(action, *args) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    options = parser.parse_args()

    layers = 16
    width = int((options.gb * 1e9 / 4 / layers) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9

    times: dict[str, list[float]] = {"save": [], "save, no checksums": []}
    loads: dict[str, list[float]] = {"load": [], "load, no checksums": []}
    with tempfile.TemporaryDirectory(dir=options.dir) as directory:
        for trial in range(options.repeats * 2):
            checksums = trial % 4 in (0, 3)  # ABBA: drifts in the machine's speed cancel
            label = "" if checksums else ", no checksums"
            target = Path(directory) / f"checkpoint_{trial}"
            # Each save into a new directory, after the last one's data reached the
            # disk: no save pays for the previous one's write-back or deletion.
            os.sync()
            with contextlib.nullcontext() if checksums else checksums_off():
                times["save" + label].append(timed(accelerator.save_state, target))
                loads["load" + label].append(timed(accelerator.load_state, target))
            shutil.rmtree(target)

    print(f"checkpoint of {size:.2f} GB (weights), median of {options.repeats}:")
    for label, values in {**times, **loads}.items():
        print(f"  {label:<22} {statistics.median(values):6.2f} s")
    for what, with_sums, without in (
        ("save", times["save"], times["save, no checksums"]),
        ("load", loads["load"], loads["load, no checksums"]),
    ):
        share = statistics.median(with_sums) / statistics.median(without) - 1
        print(f"  checksums' cost on the {what}: {share:+.1%}")


if __name__ == "__main__":
    main()
