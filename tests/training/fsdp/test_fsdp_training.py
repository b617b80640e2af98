"""FSDP2 on two CPU workers (gloo): same training as DDP, a fraction of the memory.

Each worker trains the same model twice from the same start, once wrapped in
DDP and once sharded with `fully_shard`, on the same batches, and returns both
loss curves and the whole final weights.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin
from notebook_accel.training.fsdp import parameter_bytes

FEATURES, HIDDEN, SAMPLES = 8, 32, 64


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _model(hidden: int = HIDDEN, blocks: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        *[Block(hidden) for _ in range(blocks)],
        torch.nn.Linear(hidden, 1),
    )


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g)
    )


def _train(plugin, mixed_precision: str, accumulation: int, clip: bool) -> dict:
    acc = Accelerator(
        fsdp_plugin=plugin,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=accumulation,
    )
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(), batch_size=8))
    losses, norms, unreduced = [], [], []
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if not acc.sync_gradients:  # gradients stay local: nothing reduced yet
                unreduced.append(all(p.grad is None for p in model.parameters()))
            if clip and acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return {
        "losses": losses,
        "norms": norms,
        "unreduced": unreduced,
        "weights": acc.get_state_dict(model),
        "model_class": type(acc.unwrap_model(model)).__name__,
    }


def _fsdp_and_ddp(options: dict, mixed_precision: str, accumulation: int, clip: bool):
    plugin = FullyShardedDataParallelPlugin(**options)
    return {
        "fsdp": _train(plugin, mixed_precision, accumulation, clip),
        "ddp": _train(None, mixed_precision, accumulation, clip),
    }


@pytest.mark.parametrize(
    "options,mixed_precision,accumulation,clip,tolerance",
    [
        pytest.param(
            {"transformer_cls_names_to_wrap": ["Block"]}, "no", 1, False, 1e-5, id="blocks"
        ),
        pytest.param({"min_num_params": 500}, "no", 2, True, 1e-5, id="size-accumulate-clip"),
        pytest.param(
            {"reshard_after_forward": False, "cpu_offload": True},
            "no",
            1,
            True,
            1e-5,
            id="no-reshard-offload",
        ),
        pytest.param(
            {"transformer_cls_names_to_wrap": ["Block"]}, "bf16", 1, True, 2e-2, id="bf16"
        ),
    ],
)
def test_fsdp_follows_the_ddp_loss_curve(options, mixed_precision, accumulation, clip, tolerance):
    results = notebook_launcher(
        _fsdp_and_ddp,
        args=(options, mixed_precision, accumulation, clip),
        num_processes=2,
        return_all=True,
        live=False,
        timeout=90,
        backend="cpu",
    )
    main = results[0]
    fsdp, ddp = main["fsdp"], main["ddp"]
    print("FSDP losses", [round(v, 5) for v in fsdp["losses"]])
    print("DDP losses ", [round(v, 5) for v in ddp["losses"]])
    assert fsdp["model_class"] == "FSDPSequential"
    assert ddp["model_class"] == "Sequential"
    assert len(fsdp["losses"]) == SAMPLES // 16
    torch.testing.assert_close(fsdp["losses"], ddp["losses"], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fsdp["norms"], ddp["norms"], rtol=tolerance, atol=tolerance)
    assert fsdp["losses"][-1] < fsdp["losses"][0]
    # On accumulation steps FSDP keeps unsharded local gradients (no reduce-scatter).
    assert fsdp["unreduced"] == [True] * (len(fsdp["losses"]) // 2 if accumulation > 1 else 0)
    assert set(fsdp["weights"]) == set(ddp["weights"])
    for name, value in ddp["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], value, rtol=tolerance, atol=tolerance)
    # Gathered on the main process only.
    assert results[1]["fsdp"]["weights"] == {}


def _memory() -> dict:
    figures = {}
    for name, plugin in (
        ("ddp", None),
        ("fsdp", FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])),
    ):
        acc = Accelerator(fsdp_plugin=plugin)
        model = _model(hidden=256, blocks=4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model, optimizer = acc.prepare(model, optimizer)
        acc.backward(model(torch.randn(4, FEATURES)).sum())
        optimizer.step()
        state = sum(
            t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        figures[name] = {"parameters": parameter_bytes(acc.unwrap_model(model)), "adam": state}
    return figures


def test_parameter_memory_per_rank_is_about_half_of_ddp():
    results = notebook_launcher(
        _memory, num_processes=2, return_all=True, live=False, timeout=60, backend="cpu"
    )
    for rank, figures in enumerate(results):
        ratio = figures["fsdp"]["parameters"] / figures["ddp"]["parameters"]
        adam_ratio = figures["fsdp"]["adam"] / figures["ddp"]["adam"]
        print(
            f"rank {rank}: parameters DDP {figures['ddp']['parameters']} B, "
            f"FSDP {figures['fsdp']['parameters']} B ({ratio:.3f}x); "
            f"AdamW state DDP {figures['ddp']['adam']} B, FSDP {figures['fsdp']['adam']} B "
            f"({adam_ratio:.3f}x)"
        )
        assert ratio < 0.6
        assert adam_ratio < 0.6
