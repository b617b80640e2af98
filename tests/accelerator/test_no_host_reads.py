"""A prepared training step reads nothing back from the device, checked without a GPU.

On a GPU, reading a value of a device tensor (`.item()`, `bool()`, `int()`, a
data-dependent shape) makes the host wait until the device has finished every
queued step, and the GPU then idles while Python queues the next one. Every such
read goes through a few aten operators (`_local_scalar_dense` above all); a
dispatch mode records them, with the line that asked, in CPU steps that take the
same path. tests/gpu runs the same steps under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import notebook_accel
from notebook_accel import Accelerator
from notebook_accel.training.optimizers import GradientState

pytestmark = pytest.mark.timeout(120)

# aten operators that hand a device value to the host (or size a result by it)
READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose", "masked_select"}


PACKAGE = str(Path(notebook_accel.__file__).parent)


class HostReads(TorchDispatchMode):
    """Records each read of a tensor's value by the host, with the frames that asked.

    On the CPU every tensor is a host tensor, so reads that torch makes of its own
    host tensors (an optimizer's step count) are recorded too: the tests compare with
    the same hand-written step, and look for reads that the package itself asks for.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: list[list[str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS:
            stack = traceback.extract_stack()[:-1]
            self.found.append([f"{f.filename}:{f.lineno}" for f in stack])
        return func(*args, **(kwargs or {}))

    def asked_by(self, prefix: str = PACKAGE) -> list[str]:
        """The reads asked for by code under `prefix` itself (not by torch code it called)."""
        asked = []
        for frames in self.found:
            # the innermost frame that is not the dispatch machinery asked for the value
            inner = [f for f in frames if not any(part in f for part in MACHINERY)]
            if inner and inner[-1].startswith(prefix):
                asked.append(" < ".join(reversed(inner[-4:])))
        return asked


# torch's own frames between a tensor method and the dispatch mode
MACHINERY = (
    "_python_dispatch.py",
    "_ops.py",
    "_tensor.py",
    "overrides.py",
    "_compile.py",
    "eval_frame.py",
)


@pytest.fixture(autouse=True)
def fresh_state():
    GradientState._reset_state()
    yield
    GradientState._reset_state()


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(3, (40,), generator=generator)), batch_size=8)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def prepared_steps(precision: str, fused: bool, accumulation: int = 1) -> tuple[HostReads, list]:
    """Steps of a prepared loop; the reads recorded after the first (warm-up) step."""
    accelerator = Accelerator(
        cpu=True, mixed_precision=precision, gradient_accumulation_steps=accumulation
    )
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused or None)
    net, optimizer, loader = accelerator.prepare(net, optimizer, data())
    reads = HostReads()
    gathered = []
    for index, (x, y) in enumerate(loader):
        # the first step is a warm-up, outside the recording (lazy state is made there)
        with reads if index > 0 else contextlib.nullcontext():
            with accelerator.accumulate(net):
                logits = net(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            gathered.append(accelerator.gather_for_metrics(logits.argmax(dim=1)))
    return reads, gathered


def hand_written_steps(precision: str, fused: bool) -> HostReads:
    """The same steps written by hand: autocast, a GradScaler under fp16."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused or None)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    reads = HostReads()
    for index, (x, y) in enumerate(data()):
        with reads if index > 0 else contextlib.nullcontext():
            with torch.autocast("cpu", dtype) if dtype else contextlib.nullcontext():
                logits = net(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
    return reads


@pytest.mark.parametrize(
    "precision, fused",
    [("no", False), ("bf16", False), ("no", True), ("fp16", True), ("fp16", False)],
)
def test_a_prepared_step_reads_what_the_hand_written_step_reads(precision, fused):
    """Nothing beyond what torch itself reads in the same hand-written step: under fp16
    with a plain optimizer, GradScaler reads the overflow flag once per step (a fused
    optimizer skips the step on the device and nothing is read)."""
    ours, gathered = prepared_steps(precision, fused)
    assert ours.asked_by() == []
    assert len(ours.found) == len(hand_written_steps(precision, fused).found)
    assert sum(len(g) for g in gathered) == 40  # gather_for_metrics: one item per sample


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_accumulating_steps_read_nothing_either(precision):
    ours, _ = prepared_steps(precision, fused=True, accumulation=2)
    assert ours.asked_by() == []


def test_the_recorder_sees_a_read_the_package_makes(monkeypatch):
    """The check can fail: a step that asks for a loss value is caught, with its line."""
    from notebook_accel.training.optimizers import AcceleratedOptimizer

    real_step = AcceleratedOptimizer.step

    def step_reading_a_gradient(self, closure=None):
        bool(self.param_groups[0]["params"][0].grad.abs().sum() > 0)
        return real_step(self, closure)

    monkeypatch.setattr(AcceleratedOptimizer, "step", step_reading_a_gradient)
    ours, _ = prepared_steps("no", fused=True)
    assert len(ours.asked_by(__file__)) == 4  # each recorded step read once
    assert ours.asked_by() == []  # and not by the package


def test_a_fused_optimizer_says_it_skipped_an_overflowed_step_when_asked():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    x, y = next(iter(data()))

    def step(scale: float = 1.0) -> None:
        loss = torch.nn.functional.cross_entropy(net(x), y) * scale
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    step()
    assert not optimizer.step_was_skipped
    before = [p.detach().clone() for p in net.parameters()]
    lr = scheduler.get_last_lr()
    step(float("inf"))
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert all(torch.equal(p, old) for p, old in zip(net.parameters(), before, strict=True))
    assert scheduler.get_last_lr() == lr  # the scheduler stayed put
    step()
    assert not optimizer.step_was_skipped
    assert scheduler.get_last_lr() == [lr[0] / 2]
    optimizer._is_overflow = True  # Accelerate's name, set by code that says so
    assert optimizer.step_was_skipped
