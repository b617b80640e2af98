"""notebook_accel.big_modeling and Accelerate 1.15 on the same models: the same outputs,
weights after the hooks are removed, maps, warnings, loaded checkpoints and helper results.

The maps of many budgets are compared in test_device_map_differential.py; here what comes
with them (warnings, logs), and everything around hooks and loading.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import notebook_accel.big_modeling as ours
from tests_support import dev_dependency

accelerate = dev_dependency("accelerate")
from accelerate import big_modeling as their_big_modeling  # noqa: E402
from accelerate import hooks as their_hooks  # noqa: E402
from accelerate.utils import modeling as their_modeling  # noqa: E402
from accelerate.utils import other as their_other  # noqa: E402

LIBRARIES = {
    "ours": ours,
    "accelerate": type(
        "Accelerate",
        (),
        {
            name: staticmethod(getattr(module, name))
            for module in (their_big_modeling, their_hooks, their_modeling, their_other)
            for name in dir(module)
            if callable(getattr(module, name)) and not name.startswith("_")
        },
    ),
}


class Net(nn.Module):
    """Linear layers, a batch norm (buffers), a non-persistent buffer and a preloaded block
    that reads its child's weight directly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.block = Direct(4, 5)
        self.linear2 = nn.Linear(5, 5)
        self.register_buffer("shift", torch.full((5,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.block(self.batchnorm(self.linear1(x)))) + self.shift


class Direct(nn.Module):
    """Uses `inner.weight` without calling `inner`: needs preload_module_classes."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.inner = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.inner.weight.t() + self.inner.bias


def _net() -> Net:
    torch.manual_seed(0)
    model = Net().eval()
    model.batchnorm.running_mean.fill_(0.1)
    return model


X = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))

OFFLOADS = {
    "cpu_offload": lambda lib, m, d: lib.cpu_offload(m, preload_module_classes=["Direct"]),
    "cpu_offload buffers": lambda lib, m, d: lib.cpu_offload(
        m, offload_buffers=True, preload_module_classes=["Direct"]
    ),
    "disk_offload": lambda lib, m, d: lib.disk_offload(m, d, preload_module_classes=["Direct"]),
    "disk_offload buffers": lambda lib, m, d: lib.disk_offload(
        m, d, offload_buffers=True, preload_module_classes=["Direct"]
    ),
    "dispatch cpu and disk": lambda lib, m, d: lib.dispatch_model(
        m,
        {"linear1": "disk", "batchnorm": "cpu", "block": "disk", "linear2": "cpu"},
        offload_dir=d,
        preload_module_classes=["Direct"],
    ),
    "dispatch all to disk": lambda lib, m, d: lib.dispatch_model(
        m,
        {"linear1": "disk", "batchnorm": "disk", "block": "disk", "linear2": "disk"},
        offload_dir=d,
        preload_module_classes=["Direct"],
    ),
}


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "GPU 0 not available" notes
    yield
    logging.getLogger("accelerate").setLevel(logging.NOTSET)


@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_offload_run_remove_run_again_as_accelerate(offload, tmp_path):
    with torch.no_grad():
        expected = _net()(X)
    start = _net().state_dict()
    results = {}
    for name, lib in LIBRARIES.items():
        model = _net()
        with torch.no_grad():
            OFFLOADS[offload](lib, model, tmp_path / name / "first")
            first = model(X)
            # Accelerate's raises here: a preloaded block's child has no hook of its own
            state = ours.get_state_dict_offloaded_model(model) if lib is ours else start
            lib.remove_hook_from_submodules(model)
            after = {k: v.clone() for k, v in model.state_dict().items()}
            OFFLOADS[offload](lib, model, tmp_path / name / "again")
            again = model(X)
        results[name] = (first, state, after, again)
    for first, state, after, again in results.values():
        torch.testing.assert_close(first, expected)
        torch.testing.assert_close(again, expected)
        for key, value in start.items():
            assert torch.equal(after[key], value), key  # the weights as they were
            assert torch.equal(state[key], value), key


def test_state_dict_of_an_offloaded_model_as_accelerate(tmp_path):
    states = {}
    for name, lib in LIBRARIES.items():
        model = nn.Sequential(_net().linear1, _net().batchnorm, nn.Sequential(_net().linear2))
        lib.disk_offload(model, tmp_path / name)
        states[name] = lib.get_state_dict_offloaded_model(model)
    assert list(states["ours"]) == list(states["accelerate"])
    for key, value in states["accelerate"].items():
        assert states["ours"][key].device == value.device and torch.equal(
            states["ours"][key], value
        )


def _buffered(extra_layer: bool) -> nn.Module:
    model = nn.Sequential(
        OrderedDict(
            [
                ("linear1", nn.Linear(3, 4)),
                ("batchnorm", nn.BatchNorm1d(4)),
                ("linear2", nn.Linear(4, 5)),
            ]
        )
    )
    model.linear1.register_buffer("extra", torch.zeros(10, 2))
    model.batchnorm.register_buffer("extra", torch.zeros(10, 3))
    model.linear2.register_buffer("extra", torch.zeros(10, 3))
    if extra_layer:
        model.add_module("linear3", nn.Linear(5, 5))
        model.linear3.register_buffer("extra", torch.zeros(10, 2))
    return model


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _map_and_what_is_said(lib, model, budget, **options):
    records = _Records()
    loggers = [
        logging.getLogger(n) for n in ("accelerate.utils.modeling", ours.device_map.__name__)
    ]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            device_map = lib.infer_auto_device_map(model, max_memory=dict(budget), **options)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
            logger.setLevel(logging.NOTSET)
    buffer_warnings = [w for w in caught if "offload_buffers" in str(w.message)]
    empty = any("insufficient memory" in m for m in records.messages)
    return dict(device_map), len(buffer_warnings), empty


@pytest.mark.parametrize("extra_layer", [False, True])
def test_maps_warnings_and_logs_as_accelerate(extra_layer):
    model = _buffered(extra_layer)
    compared = said = logged = 0
    for budget in (
        {0: 400, "cpu": 10**9},
        {0: 400, 1: 400, "cpu": 10**9},
        {0: 400, 1: 200, "cpu": 10**9},
        {0: 300, 1: 800, "cpu": 10**9},
        {0: 150, "cpu": 300},
        {0: 30, "cpu": 200},
        {0: 100},
        {"cpu": 300},
        {0: 678},
    ):
        for offload_buffers in (False, True):
            for fallback in (False, True):
                options = dict(offload_buffers=offload_buffers, fallback_allocation=fallback)
                theirs = _map_and_what_is_said(LIBRARIES["accelerate"], model, budget, **options)
                mine = _map_and_what_is_said(ours, model, budget, **options)
                assert mine == theirs, (budget, options)
                compared += 1
                said += theirs[1]
                logged += theirs[2]
    assert compared == 36 and said and logged  # both kinds of message were compared


def test_check_device_map_as_accelerate():
    model = _buffered(False)
    for lib in LIBRARIES.values():
        with pytest.warns(UserWarning, match="device_map keys do not match any submodules"):
            lib.check_device_map(model, {"": 0, "nothing": 1})
        with pytest.raises(ValueError):
            lib.check_device_map(model, {"linear1": 0, "linear2": 1})
        lib.check_device_map(model, {"linear1": 0, "linear2": 1, "batchnorm": 1})


@pytest.mark.parametrize(
    "size",
    [
        0,
        500,
        "0MB",
        "100MB",
        "2GiB",
        "512KiB",
        "1.5GB",
        "100KB",
        "8Mb",
        "5MBB",
        "5k0MB",
        "-1GB",
        -5,
        "12",
    ],
)
def test_convert_file_size_to_int_as_accelerate(size):
    outcomes = []
    for lib in LIBRARIES.values():
        try:
            outcomes.append(lib.convert_file_size_to_int(size))
        except ValueError:
            outcomes.append(ValueError)
    assert outcomes[0] == outcomes[1]


def test_checkpoints_load_as_accelerate(tmp_path, caplog):
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    source = _net()
    state = source.state_dict() | {"foo": torch.rand(4, 5)}
    torch.save(state, tmp_path / "whole.pt")
    files = {
        "linear1": "part1.bin",
        "batchnorm": "part2.bin",
        "block": "part3.bin",
        "linear2": "part3.bin",
    }
    for file in set(files.values()):
        part = {k: v for k, v in source.state_dict().items() if files[k.split(".")[0]] == file}
        torch.save(part, tmp_path / file)
    flat = {k: files[k.split(".")[0]] for k in source.state_dict()}
    (tmp_path / "flat.index.json").write_text(json.dumps(flat))
    for checkpoint in ("whole.pt", "flat.index.json"):
        for device_map in (None, {"": "cpu"}):
            loaded = {}
            for name, lib in LIBRARIES.items():
                model = Net()
                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    lib.load_checkpoint_in_model(
                        model, str(tmp_path / checkpoint), device_map=device_map
                    )
                assert ("foo" in caplog.text) == (checkpoint == "whole.pt"), name
                loaded[name] = model.state_dict()
            for key, value in source.state_dict().items():
                assert torch.equal(loaded["ours"][key], value)
                assert torch.equal(loaded["accelerate"][key], value)
            if checkpoint == "whole.pt":
                for lib in LIBRARIES.values():
                    with pytest.raises((ValueError, RuntimeError)):
                        lib.load_checkpoint_in_model(
                            Net(), str(tmp_path / checkpoint), device_map=device_map, strict=True
                        )


def test_load_state_dict_and_dtypes_as_accelerate(tmp_path):
    source = _net()
    safe = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(safe, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    device_map = {"linear1": "cpu", "batchnorm": "disk", "block": "cpu", "linear2": "cpu"}
    theirs = their_modeling.load_state_dict(str(tmp_path / "m.safetensors"), device_map=device_map)
    mine = ours.load_state_dict(str(tmp_path / "m.safetensors"), device_map=device_map)
    assert sorted(mine) == sorted(theirs)
    for key in theirs:
        assert mine[key].device == theirs[key].device and torch.equal(mine[key], theirs[key])
    torch.save(source.state_dict(), tmp_path / "m.pt")
    dtypes = {}
    for name, lib in LIBRARIES.items():
        model = Net()
        lib.load_checkpoint_in_model(
            model, str(tmp_path / "m.pt"), dtype=torch.float16, device_map={"": "cpu"}
        )
        dtypes[name] = {k: v.dtype for k, v in model.state_dict().items()}
    assert dtypes["ours"] == dtypes["accelerate"]


def test_tensor_helpers_as_accelerate():
    model = _net()
    model.batchnorm.register_buffer("scratch", torch.zeros(3), persistent=False)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
    for layer in layers[1:]:
        layer.weight = layers[0].weight
    sizes = their_modeling.compute_module_sizes(layers)
    tied = sorted(f"{i}.weight" for i in range(1, 12))
    queue = list(layers.named_children())[1:]
    results = {}
    for name, lib in LIBRARIES.items():
        lists = [
            [n for n, _ in lib.named_module_tensors(module, **options)]
            for module in (model, model.batchnorm, model.block)
            for options in (
                {},
                {"recurse": True},
                {"include_buffers": False, "recurse": True},
                {"remove_non_persistent": True},
            )
        ]
        # Recursing, Accelerate tells non-persistent buffers by their last name only, and
        # keeps "batchnorm.scratch"; by full name, what is left is the state dict's.
        kept = [
            n for n, _ in lib.named_module_tensors(model, recurse=True, remove_non_persistent=True)
        ]
        lists.append(sorted(n for n in kept if n != "batchnorm.scratch"))
        if lib is ours:
            assert sorted(kept) == sorted(model.state_dict())
        sequential = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
        lib.retie_parameters(sequential, [["0.weight", "2.weight"]])
        results[name] = (
            lists,
            lib.get_non_persistent_buffers(model, recurse=True),
            lib.get_non_persistent_buffers(model.batchnorm),
            lib.compute_module_total_buffer_size(model),
            lib.compute_module_total_buffer_size(model.half()),
            lib.get_module_size_with_ties(tied, sizes["0"], sizes, queue),
            lib.find_tied_parameters(sequential),
        )
        model.float()
    assert results["ours"] == results["accelerate"]
    messages = []
    for lib in LIBRARIES.values():
        with pytest.raises(ValueError) as error:
            lib.set_module_tensor_to_device(model, "linear1.weight", "cpu", value=torch.zeros(2, 2))
        messages.append(str(error.value))
    assert messages[0] == messages[1]


def test_align_module_device_as_accelerate():
    seen = {}
    for name, lib in LIBRARIES.items():
        model = lib.cpu_offload(_net())
        devices = []
        for module in model.modules():
            with lib.align_module_device(module, "cpu"):
                devices.append(sorted({str(p.device) for p in model.parameters()}))
                devices.append(sorted({str(p.device) for p in module.parameters(recurse=False)}))
        devices.append(sorted({str(p.device) for p in model.parameters()}))
        seen[name] = devices
    assert seen["ours"] == seen["accelerate"]


def test_extract_model_from_parallel_as_accelerate():
    inner = nn.Linear(3, 2)
    for recursive in (False, True):
        model = nn.DataParallel(nn.Sequential(nn.DataParallel(inner)))
        theirs = their_other.extract_model_from_parallel(model, recursive=recursive)
        model = nn.DataParallel(nn.Sequential(nn.DataParallel(inner)))
        mine = ours.extract_model_from_parallel(model, recursive=recursive)
        assert type(mine) is type(theirs) and type(mine[0]) is type(theirs[0])
