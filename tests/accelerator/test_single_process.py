"""The Accelerator in one process: state, prepare, accumulation, precision, helpers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedType,
    GradScalerKwargs,
    LaunchSettings,
    get_logger,
    progress_bar,
    set_progress_hook,
    set_seed,
)
from notebook_accel.training.loader import DataLoaderShard
from notebook_accel.training.optimizers import AcceleratedOptimizer, AcceleratedScheduler
from notebook_accel.training.state import split_between as _split

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LaunchSettings().to_env())


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    """Each test starts as a plain process: no launch, no torchrun variables."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _data(n=16, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randn(n, 1, generator=g)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_a_plain_process_is_a_one_process_accelerator():
    acc = Accelerator()
    assert (acc.num_processes, acc.process_index, acc.local_process_index) == (1, 0, 0)
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.distributed_type == DistributedType.NO == "NO"
    assert acc.device == torch.device("cpu")
    assert acc.mixed_precision == "no" and acc.gradient_accumulation_steps == 1
    assert acc.sync_gradients and not acc.use_distributed


def test_launch_settings_apply_and_explicit_arguments_win(monkeypatch):
    for name, value in LaunchSettings("cpu", "bf16", 3).to_env().items():
        monkeypatch.setenv(name, value)
    acc = Accelerator()
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("bf16", 3)
    acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=1)
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("no", 1)


def test_bad_precision_and_fp8_on_cpu_are_refused_before_training():
    with pytest.raises(ValueError, match="fp16, bf16, fp8"):
        Accelerator(mixed_precision="fp9")
    with pytest.raises(ValueError, match="compute capability 8.9.*torchao"):
        Accelerator(mixed_precision="fp8")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(TypeError, match="kwargs_handlers"):
        Accelerator(kwargs_handlers=[object()])


def test_prepare_keeps_order_and_wraps_each_kind():
    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loader = DataLoader(TensorDataset(*_data()), batch_size=4)
    out = acc.prepare(sched, loader, model, opt)
    assert isinstance(out[0], AcceleratedScheduler) and out[0].optimizers == [out[3]]
    assert isinstance(out[1], DataLoaderShard) and isinstance(out[1], DataLoader)
    assert out[2] is model  # one process: no DDP wrapper
    assert isinstance(out[3], AcceleratedOptimizer) and out[3].optimizer is opt
    assert acc.prepare(model) is model


def _train(acc, model, opt, loader, sched=None):
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
    return model


def test_accumulation_equals_one_big_batch_and_steps_the_scheduler_per_update():
    x, y = _data(16)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start in range(0, 16, 8):  # 2 steps on batches of 8
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(
            reference(x[start : start + 8]), y[start : start + 8]
        ).backward()
        ref_opt.step()

    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched, loader = acc.prepare(
        model, opt, sched, DataLoader(TensorDataset(x, y), batch_size=4)
    )
    # The schedule must not move: it is checked against lr 0.1 for both steps.
    sched.scheduler.gamma = 1.0
    _train(acc, model, opt, loader, sched)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=False):
        torch.testing.assert_close(mine, theirs)
    assert sched.scheduler.last_epoch == 2  # 4 micro-batches, 2 real steps


def test_the_last_batch_of_a_loader_always_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(
        model, opt, DataLoader(TensorDataset(*_data(12)), batch_size=4)
    )
    syncs = []
    for x, _y in loader:
        with acc.accumulate(model):
            acc.backward(model(x).sum())
            syncs.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    assert syncs == [False, True, True]
    assert all(p.grad is None for p in model.parameters())


def test_fp16_overflow_skips_the_step_and_the_scheduler_then_training_goes_on():
    acc = Accelerator(mixed_precision="fp16")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = _data(8)

    def step(scale_loss=1.0):
        loss = torch.nn.functional.mse_loss(model(x), y) * scale_loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    step()
    before = [p.detach().clone() for p in model.parameters()]
    lr, scale = sched.get_last_lr(), acc.scaler.get_scale()
    step(scale_loss=float("inf"))
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    for p, old in zip(model.parameters(), before, strict=False):
        torch.testing.assert_close(p, old, rtol=0, atol=0)
    assert sched.get_last_lr() == lr
    assert acc.scaler.get_scale() == scale / 2
    step()
    assert not opt.step_was_skipped
    assert sched.get_last_lr() == [lr[0] / 2]
    assert any(not torch.equal(p, old) for p, old in zip(model.parameters(), before, strict=False))


def test_bf16_forward_computes_in_bf16_and_returns_float32():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_model())
    inner = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    out = model(_data()[0])
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    bare = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert bare(_data()[0]).dtype == torch.float32 and inner[-1] == torch.float32
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_clipping_under_fp16_sees_unscaled_gradients():
    norms = {}
    for precision in ("no", "fp16"):
        acc = Accelerator(
            mixed_precision=precision, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]
        )
        model = acc.prepare(_model())
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = _data(8)
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        norms[precision] = acc.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
        acc.clip_grad_value_(model.parameters(), 1e9)  # a second unscale must not raise
        opt.step()
    assert norms["fp16"] == pytest.approx(norms["no"], rel=2e-2)


def test_collectives_in_one_process_keep_shapes():
    acc = Accelerator()
    data = {"a": torch.arange(3), "b": [torch.tensor(2.0)]}
    gathered = acc.gather(data)
    assert torch.equal(gathered["a"], torch.arange(3)) and gathered["b"][0].shape == (1,)
    assert torch.equal(acc.reduce(torch.tensor([2.0]), "mean"), torch.tensor([2.0]))
    assert acc.gather_object("x") == ["x"] and acc.gather_object([1, 2]) == [1, 2]
    assert torch.equal(acc.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
    with pytest.raises(TypeError, match="gather_object"):
        acc.gather({"text": "not a tensor"})
    with pytest.raises(ValueError, match="sum, mean, max"):
        acc.reduce(torch.ones(1), "median")
    with acc.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]


@pytest.mark.parametrize("pad", [False, True])
def test_split_between_processes_shares(pad):
    items = list(range(7))
    parts = [_split(items, rank, 3, pad) for rank in range(3)]
    if pad:
        assert parts == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]
    else:
        assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    tensors = [_split(torch.arange(7), rank, 3, pad) for rank in range(3)]
    assert [t.tolist() for t in tensors] == parts
    split_dict = _split({"a": items, "b": torch.arange(7)}, 2, 3, pad)
    assert split_dict["a"] == parts[2] and split_dict["b"].tolist() == parts[2]


def test_set_seed_reproduces_and_device_specific_offsets(monkeypatch):
    set_seed(3)
    first = torch.rand(3)
    set_seed(3)
    assert torch.equal(torch.rand(3), first)
    monkeypatch.setenv("RANK", "1")
    set_seed(2, device_specific=True)
    assert torch.equal(torch.rand(3), first)


def test_logger_logs_on_the_main_process_only_unless_asked(monkeypatch, caplog):
    logger = get_logger("notebook_accel.test", log_level="INFO")
    with caplog.at_level(logging.INFO):
        logger.info("from main")
        monkeypatch.setenv("RANK", "1")
        logger.info("hidden")
        logger.info("shown everywhere", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["from main", "shown everywhere"]


def test_progress_bar_feeds_the_hook_on_the_main_process_only(monkeypatch):
    updates = []
    previous = set_progress_hook(lambda step, total, elapsed: updates.append((step, total)))
    try:
        assert list(progress_bar(range(3))) == [0, 1, 2]
        assert updates == [(0, 3), (1, 3), (2, 3), (3, 3)]
        monkeypatch.setenv("RANK", "1")
        assert list(progress_bar(range(3))) == [0, 1, 2] and len(updates) == 4
    finally:
        set_progress_hook(previous)


def test_progress_bar_renders_with_rich_without_a_hook(capsys):
    assert list(progress_bar(iter(range(4)), total=4, description="train")) == [0, 1, 2, 3]
    assert "train" in capsys.readouterr().out


def test_dataloader_config_options_reach_the_loader():
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=5)
    acc = Accelerator(dataloader_config=config)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=5, shuffle=True))
    first, second = [[b[0].tolist() for b in loader] for _ in range(2)]
    assert first != second  # a new order each epoch
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first
    # dispatch_batches=True is accepted: each process reads what it would be sent
    dispatched = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    plain = DataLoader(TensorDataset(torch.arange(10)), batch_size=5)
    assert [b[0].tolist() for b in dispatched.prepare(plain)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_fp8_on_an_older_gpu_names_each_missing_piece(monkeypatch):
    import importlib.util

    from notebook_accel.platforms import CudaPlatform, GpuInfo, Hardware

    a100 = Hardware(gpus=(GpuInfo(0, "A100", 40 << 30, (8, 0)),))
    h100 = Hardware(gpus=(GpuInfo(0, "H100", 80 << 30, (9, 0)),))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    problem = CudaPlatform().precision_problem("fp8", a100)
    assert "8.9" in problem and "A100 has 8.0" in problem and "torchao" in problem
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert CudaPlatform().precision_problem("fp8", h100) is None
