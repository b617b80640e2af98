"""The main job: train a small classifier on synthetic data on every device here.

python -m notebook_accel.demo            # 2 CPU workers, or every GPU
notebook-accel demo --processes 4 --epochs 5
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def make_dataset(samples: int, features: int, classes: int, seed: int = 0):
    """A learnable problem: labels come from a fixed random linear map of the inputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    mapping = torch.randn(features, classes, generator=generator)
    labels = (inputs @ mapping).argmax(dim=1)
    return torch.utils.data.TensorDataset(inputs, labels)


def train(
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 0.05,
    samples: int = 4096,
    features: int = 32,
    classes: int = 4,
) -> dict[str, Any]:
    """Train on this worker's share of the data; return the metrics every worker agrees on."""
    import torch

    from notebook_accel import Accelerator, set_seed

    accelerator = Accelerator()
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 128), torch.nn.ReLU(), torch.nn.Linear(128, classes)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = torch.utils.data.DataLoader(
        make_dataset(samples, features, classes), batch_size=batch_size, shuffle=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    started = time.perf_counter()
    losses = []
    for epoch in range(epochs):
        model.train()
        for inputs, labels in loader:
            with accelerator.autocast():
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        losses.append(mean_loss)
        accelerator.print(f"epoch {epoch + 1}/{epochs}: loss {mean_loss:.4f}")
    model.eval()
    correct = []
    with torch.no_grad():
        for inputs, labels in loader:
            predictions = model(inputs).argmax(dim=1)
            correct.append(accelerator.gather_for_metrics(predictions == labels))
    accuracy = torch.cat(correct).float().mean().item()
    return {
        "processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "losses": losses,
        "accuracy": accuracy,
        "evaluated_samples": int(sum(len(c) for c in correct)),
        "train_seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="notebook-accel demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="workers to start (default: every GPU, or 2 CPU workers)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="use CPU workers even with GPUs")


def run(options: argparse.Namespace) -> int:
    from notebook_accel import notebook_launcher

    started = time.perf_counter()
    result = notebook_launcher(
        train,
        args=(options.epochs,),
        num_processes=options.processes,
        mixed_precision=options.mixed_precision,
        backend="cpu" if options.cpu else None,
    )
    print(
        f"\ntrained on {result['processes']} worker(s) ({result['device']}, "
        f"precision {result['mixed_precision']}) in {time.perf_counter() - started:.1f} s"
    )
    print(f"loss per epoch: {', '.join(f'{loss:.4f}' for loss in result['losses'])}")
    print(f"accuracy: {result['accuracy']:.3f} on {result['evaluated_samples']} samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
