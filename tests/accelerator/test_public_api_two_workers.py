"""Every public Accelerator method, used once in a real two-process run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import (
    Accelerator,
    get_logger,
    notebook_launcher,
    progress_bar,
    set_progress_hook,
    set_seed,
)


def _everything_worker():
    acc = Accelerator()
    rank = acc.process_index
    out: dict = {"index": (rank, acc.local_process_index, acc.num_processes)}
    out["main"] = (acc.is_main_process, acc.is_local_main_process, acc.is_last_process)
    out["device"] = str(acc.device)

    set_seed(5, device_specific=True)
    out["seeded"] = torch.rand(1).item()

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        TensorDataset(torch.arange(12.0).view(6, 2).repeat(1, 2)[:, :3]), batch_size=1
    )
    model, opt, loader = acc.prepare(model, opt, loader)
    for (x,) in loader:
        with acc.no_sync(model):  # DDP needs the forward inside no_sync too
            with acc.autocast():
                loss = model(x).pow(2).sum()
            acc.backward(loss)
        local_grad = acc.unwrap_model(model).weight.grad.clone()
        out["no_sync_local"] = not torch.equal(acc.reduce(local_grad, "mean"), local_grad)
        out["norm"] = acc.clip_grad_norm_(model.parameters(), 1.0).item()
        acc.clip_grad_value_(model.parameters(), 0.5)
        out["clipped"] = acc.unwrap_model(model).weight.grad.abs().max().item()
        opt.step()
        opt.zero_grad()
        break
    out["unwrapped"] = type(acc.unwrap_model(model)).__name__

    out["gather"] = acc.gather(torch.tensor([rank])).tolist()
    out["gather_nested"] = acc.gather({"a": [torch.tensor(rank)]})["a"][0].tolist()
    out["gather_object"] = acc.gather_object([f"r{rank}"])
    out["reduce_sum"] = acc.reduce(torch.tensor([rank + 1.0])).item()
    out["reduce_mean"] = acc.reduce(torch.tensor([rank + 1.0]), reduction="mean").item()
    padded = acc.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1)
    out["pad"] = padded.tolist()
    out["pad_first"] = acc.pad_across_processes(torch.ones(rank + 1), pad_first=True).tolist()
    ragged = torch.nested.nested_tensor([torch.ones(rank + 1), torch.ones(2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["pad_nested_same"] = acc.pad_across_processes(ragged) is ragged
    out["pad_nested_warned"] = [type(w.message).__name__ for w in caught]
    out["broadcast"] = acc.broadcast(torch.tensor([rank * 10])).tolist()
    with acc.split_between_processes(list(range(5)), apply_padding=True) as part:
        out["split"] = part
    with acc.split_between_processes(torch.arange(5)) as part:
        out["split_tensor"] = part.tolist()

    order = []
    with acc.main_process_first():
        order.append(("inside", rank))
    out["main_first"] = order
    acc.wait_for_everyone()

    @acc.on_main_process
    def on_main():
        return "main"

    @acc.on_local_main_process
    def on_local_main():
        return "local main"

    @acc.on_process(process_index=1)
    def on_one():
        return "one"

    out["decorated"] = (on_main(), on_local_main(), on_one())

    if rank == 1:
        acc.set_trigger()
    out["trigger"] = acc.check_trigger()
    out["trigger_reset"] = acc.check_trigger()

    acc.print(f"printed by rank {rank}")
    logger = get_logger("notebook_accel.worker", log_level="INFO")
    handler_records = []
    handler = logging.Handler()
    handler.emit = lambda record: handler_records.append(record.getMessage())
    logger.logger.addHandler(handler)
    logger.info("once")
    logger.info("everyone", main_process_only=False)
    logger.info("in order", main_process_only=False, in_order=True)
    out["logged"] = handler_records

    updates = []
    set_progress_hook(lambda step, total, elapsed: updates.append(step))
    for _ in progress_bar(range(3)):
        pass
    out["progress"] = updates
    return out


def test_every_public_method_in_two_workers(capfd):
    r0, r1 = notebook_launcher(_everything_worker, num_processes=2, return_all=True, backend="cpu")
    assert (r0["index"], r1["index"]) == ((0, 0, 2), (1, 1, 2))
    assert r0["main"] == (True, True, False) and r1["main"] == (False, False, True)
    assert r0["device"] == "cpu"
    assert r0["seeded"] != r1["seeded"]  # device_specific seeds differ
    assert r0["no_sync_local"] and r1["no_sync_local"]  # gradients were not averaged
    assert r0["clipped"] <= 0.5 and r0["norm"] > 0
    assert r0["unwrapped"] == "Linear"
    assert r0["gather"] == r1["gather"] == [0, 1]
    assert r0["gather_nested"] == [0, 1]
    assert r0["gather_object"] == r1["gather_object"] == ["r0", "r1"]
    assert r0["reduce_sum"] == 3.0 and r1["reduce_mean"] == 1.5
    assert r0["pad"] == [[1.0, 1.0], [-1.0, -1.0]] and r1["pad"] == [[1.0, 1.0]] * 2
    assert r0["pad_first"] == [0.0, 1.0]
    for result in (r0, r1):  # a nested tensor has no one size to pad: left as it is, said so
        assert result["pad_nested_same"]
        assert result["pad_nested_warned"] == ["CannotPadNestedTensorWarning"]
    assert r0["broadcast"] == r1["broadcast"] == [0]
    assert (r0["split"], r1["split"]) == ([0, 1, 2], [3, 4, 4])
    assert (r0["split_tensor"], r1["split_tensor"]) == ([0, 1, 2], [3, 4])
    assert r0["decorated"] == ("main", "local main", None)
    assert r1["decorated"] == (None, None, "one")
    assert r0["trigger"] and r1["trigger"] and not r0["trigger_reset"]
    assert r0["logged"] == ["once", "everyone", "in order"]
    assert r1["logged"] == ["everyone", "in order"]
    assert r0["progress"] == [0, 1, 2, 3] and r1["progress"] == []
    printed = capfd.readouterr().out
    assert "printed by rank 0" in printed and "printed by rank 1" not in printed


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from notebook_accel import Accelerator
    acc = Accelerator()
    total = acc.reduce(torch.tensor([acc.process_index + 1.0])).item()
    print(f"rank={acc.process_index} world={acc.num_processes} total={total} "
          f"type={acc.distributed_type}", flush=True)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    """
)


def test_the_accelerator_joins_a_torchrun_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NOTEBOOK_ACCEL_BACKEND", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank={rank} world=2 total=3.0 type=MULTI_CPU" in done.stdout


def test_importing_the_package_loads_no_torch_and_the_accelerator_no_ui():
    code = (
        "import sys, notebook_accel;"
        "assert 'torch' not in sys.modules, 'torch';"
        "notebook_accel.Accelerator;"
        "heavy = {'rich', 'yaml', 'ipywidgets', 'accelerate'} & set(sys.modules);"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
