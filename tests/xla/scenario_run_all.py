"""Run All on XLA's CPU device: a launch, the kernel's own training at once, a launch.

Run by test_xla_cpu_device.py in a fresh interpreter of the torch_xla environment
(nothing heavy imported yet, as in a new kernel). Prints one JSON line; a step
that goes wrong raises, so the script exits non-zero.
"""

from __future__ import annotations

import json
import sys

import torch

from notebook_accel import Accelerator, last_run, notebook_launcher


def train() -> str:
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(3, 4, device=accelerator.device)).sum())
    optimizer.step()
    return str(accelerator.device)


def main() -> None:
    launch = {"backend": "xla", "num_processes": 1, "live": False}
    first = notebook_launcher(train, **launch)
    warming = last_run().warming
    # Outside a kernel no event loop runs between cells: the next launch imports.
    after_first = warming.status
    # The next cell, at once: training in the kernel itself, on the CPU.
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    second = notebook_launcher(train, **launch)
    seen = {"first": first, "second": second, "warming": [after_first, warming.status]}
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
