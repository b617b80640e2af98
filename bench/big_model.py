"""Big-model loading and offloaded inference against Accelerate, in the same run.

A model of 8 residual blocks (about 270 MB in float32) is saved as a sharded
safetensors checkpoint (5 shards of about 64 MB, with an index). Each library then,
in a fresh interpreter, builds it on the meta device and loads it with
`load_checkpoint_and_dispatch(device_map="auto", max_memory={"cpu": ...})`, a budget
of 40% of the model: the rest is offloaded to disk. Measured per library (median of
the repeats, alternating the libraries):
  load s              the load_checkpoint_and_dispatch call
  peak RSS above baseline   the process's peak resident memory during the load (sampled
                            every millisecond), over the baseline just before it
  load + first forward   the load and one forward: safetensors weights are memory-mapped,
                         so reading them from the file may wait for their first use
  kept RSS            resident memory after the load, over the baseline (the weights
                      kept in memory, or the pages of them read so far)
  transient           peak minus kept: what loading needed on top of what it keeps
  forward rows/s      offloaded forwards of a 64-row batch (weights read from disk)

    python bench/big_model.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH = 1024
DEPTH = 8
SHARD_BLOCKS = 2  # blocks per shard, about 64 MB
BUDGET = 0.4  # of the model, for the CPU

MODEL = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))

class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
"""

WORKER = (
    MODEL
    + """
import json, sys, time, psutil
library, checkpoint, offload, budget, width, depth = sys.argv[1:7]
if library == "ours":
    from notebook_accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
else:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
torch.set_num_threads(1)
x = torch.randn(64, 64)
with init_empty_weights():
    model = Net(int(width), int(depth))
import threading
process = psutil.Process()
base = process.memory_info().rss
highest = [base]
loading = threading.Event()
loading.set()

def watch():  # ru_maxrss would count the imports' peak too: sample the load itself
    while loading.is_set():
        highest[0] = max(highest[0], process.memory_info().rss)
        time.sleep(0.001)

watcher = threading.Thread(target=watch)
watcher.start()
start = time.perf_counter()
model = load_checkpoint_and_dispatch(
    model, checkpoint, device_map="auto", max_memory={"cpu": int(budget)},
    no_split_module_classes=["Block"], offload_folder=offload,
)
load = time.perf_counter() - start
loading.clear()
watcher.join()
kept = process.memory_info().rss
peak = max(highest[0], kept)
with torch.no_grad():
    start = time.perf_counter()
    model(x)
    first = load + time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(5):
        model(x)
    rows = 5 * 64 / (time.perf_counter() - start)
devices = sorted({str(v) for v in model.hf_device_map.values()})
print(json.dumps({
    "load": load, "first": first, "peak": peak - base, "kept": kept - base,
    "rows": rows, "devices": devices,
}))
"""
)


def save_checkpoint(folder: Path) -> tuple[int, int]:
    """Write the sharded checkpoint; returns (model bytes, largest shard bytes)."""
    import torch
    from safetensors.torch import save_file

    namespace: dict = {}
    exec(MODEL, namespace)
    torch.manual_seed(0)
    state = namespace["Net"](WIDTH, DEPTH).state_dict()
    groups: list[list[str]] = [[]]
    for key in state:
        block = key.split(".")[1] if key.startswith("blocks.") else None
        if block is not None and int(block) % SHARD_BLOCKS == 0 and key.endswith("norm.weight"):
            groups.append([])
        groups[-1].append(key)
    weight_map = {}
    largest = 0
    for number, keys in enumerate(groups, 1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys}, str(folder / name))
        weight_map.update(dict.fromkeys(keys, name))
        largest = max(largest, (folder / name).stat().st_size)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    total = sum(t.numel() * t.element_size() for t in state.values())
    return total, largest


def run(library: str, checkpoint: Path, work: Path, budget: int) -> dict:
    offload = tempfile.mkdtemp(dir=work)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WORKER,
            library,
            str(checkpoint),
            offload,
            str(budget),
            str(WIDTH),
            str(DEPTH),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = work / "checkpoint"
        checkpoint.mkdir()
        total, largest = save_checkpoint(checkpoint)
        budget = int(total * BUDGET)
        results: dict[str, list[dict]] = {"ours": [], "accelerate": []}
        for _ in range(options.repeats):
            for library in results:
                results[library].append(run(library, checkpoint, work, budget))
    mb = 2**20

    def median(library: str, key: str) -> float:
        return statistics.median(r[key] for r in results[library])

    print(
        f"model {total / mb:.0f} MB in {len(list(range(0, DEPTH, SHARD_BLOCKS))) + 1} shards "
        f"(largest {largest / mb:.0f} MB); CPU budget {budget / mb:.0f} MB, the rest on "
        f"disk ({', '.join(results['ours'][0]['devices'])}); median of {options.repeats}"
    )
    print()
    print("| | notebook_accel | Accelerate 1.15 | ratio |")
    print("|---|---|---|---|")
    rows = [
        ("load s", "load", 1, "{:.2f}", True),
        ("load + first forward s", "first", 1, "{:.2f}", True),
        ("peak RSS above baseline, MB", "peak", mb, "{:.0f}", True),
        ("kept RSS after load, MB", "kept", mb, "{:.0f}", True),
        ("transient (peak - kept), MB", None, mb, "{:.0f}", True),
        ("offloaded forward, rows/s", "rows", 1, "{:.0f}", False),
    ]
    for label, key, scale, fmt, lower_is_better in rows:
        if key is None:
            ours = median("ours", "peak") - median("ours", "kept")
            theirs = median("accelerate", "peak") - median("accelerate", "kept")
        else:
            ours, theirs = median("ours", key), median("accelerate", key)
        if ours > 0 and theirs > 0:
            ratio = f"{theirs / ours if lower_is_better else ours / theirs:.2f}x"
        else:
            ratio = "—"
        print(f"| {label} | {fmt.format(ours / scale)} | {fmt.format(theirs / scale)} | {ratio} |")
    print()
    print(f"ratio > 1: notebook_accel better. Largest shard + 10%: {1.1 * largest / mb:.0f} MB")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
