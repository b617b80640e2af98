"""An Accelerator made outside a launch on a TPU machine, run on XLA's CPU device.

Run by test_xla_cpu_device.py in the torch_xla environment with PJRT_DEVICE=CPU.
Detection is made to report a Colab v5e-1 (this machine has no TPU), so
`Accelerator()` takes the path it takes in a Colab TPU kernel, and torch_xla runs
it on its CPU device. Prints one JSON line; a step that goes wrong raises.
"""

from __future__ import annotations

import json
import sys

import torch
import torch_xla

from notebook_accel.platforms import XlaInfo, registry

registry.detect_xla = lambda environ: XlaInfo("TPU", 1, 1, "v5e-1", "colab", chip="v5e")

from notebook_accel import Accelerator, PartialState, notebook_launcher  # noqa: E402


def runtime_started() -> bool:
    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()


def train(accelerator: Accelerator | None) -> tuple[torch.Tensor, set[str]]:
    """Four SGD steps, through `accelerator` or in plain PyTorch on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(16, 4)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    if accelerator is not None:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    devices = set()
    for x, y in loader:
        devices.add(str(x.device))
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward() if accelerator is None else accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return weights(model), devices


def main() -> None:
    state = PartialState()
    seen = {
        "state": [state.platform_name, str(state.device), state.num_processes],
        "started_by_the_state": runtime_started(),
    }
    accelerator = Accelerator()
    trained, devices = train(accelerator)
    expected, _ = train(None)
    total = accelerator.reduce(torch.tensor([2.0], device=accelerator.device), "sum")
    seen.update(
        accelerator=[str(accelerator.device), accelerator.num_processes],
        batches_on=sorted(devices),
        matches_cpu=bool(torch.allclose(trained, expected, atol=1e-5)),
        reduced=float(total.item()),
        started_by_training=runtime_started(),
    )
    # The kernel now holds the XLA runtime: a launch that must fork is refused.
    try:
        notebook_launcher(print, backend="xla", num_processes=1, start_method="fork", live=False)
        seen["refused"] = ""
    except RuntimeError as error:
        seen["refused"] = str(error)
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
