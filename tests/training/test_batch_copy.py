"""How prepared loaders copy batches to the device, checked without a GPU.

The decisions (`copy_plan`) are checked as a table; the copying itself with a
platform that pins host memory and hands out a side stream, where pinning,
streams and the tensors' `.to()` are recorded instead of done (a CPU build of
torch cannot pin). tests/gpu runs the same loader on a real GPU.
"""

from __future__ import annotations

import contextlib
import pickle
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, DataLoaderConfiguration, prepare_data_loader
from notebook_accel.platforms import CpuPlatform
from notebook_accel.training import loader as loader_module
from notebook_accel.training.loader import CopyPlan, copy_plan

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "non_blocking, pins, user_pinned, workers, expected",
    [
        # CUDA (host memory can be pinned): pinned, non-blocking, side stream by default
        (None, True, False, 0, CopyPlan(True, pin_in_copy=True, side_stream=True)),
        (True, True, False, 0, CopyPlan(True, pin_in_copy=True, side_stream=True)),
        # the person pinned: the DataLoader keeps pinning, the copy does not pin again
        (None, True, True, 0, CopyPlan(True, loader_pins=True, side_stream=True)),
        # worker processes: the DataLoader's pinning thread overlaps with training
        (None, True, False, 2, CopyPlan(True, loader_pins=True, side_stream=True)),
        # non_blocking=False: blocking copies, as before, nothing pinned by us
        (False, True, False, 0, CopyPlan()),
        (False, True, True, 0, CopyPlan()),
        # CPU and XLA: non_blocking passes through to .to(), nothing else
        (None, False, False, 0, CopyPlan()),
        (True, False, True, 2, CopyPlan(non_blocking=True)),
    ],
)
def test_copy_plan(non_blocking, pins, user_pinned, workers, expected):
    assert copy_plan(non_blocking, pins, user_pinned, workers) == expected


class FakeStream:
    def __init__(self, log: list) -> None:
        self.log = log
        self.events = 0

    def record_event(self) -> str:
        self.events += 1
        event = f"{self.name} copy {self.events}"
        self.log.append(("recorded", event))
        return event

    def wait_event(self, event: str) -> None:
        self.log.append(("wait", event))

    def wait_stream(self, other) -> None:  # waits for every copy queued: not to be used
        self.log.append(("wait for everything on", other.name))


class FakeDeviceModule:
    """Stands in for torch.cuda: a current stream and a stream context."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.current = FakeStream(log)
        self.current.name = "current"

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(("on", stream.name))
        yield

    def current_stream(self, device):
        return self.current


class PinningPlatform(CpuPlatform):
    """The CPU, described as a device whose host memory can be pinned (like CUDA)."""

    pins_host_memory = True

    def __init__(self, log: list) -> None:
        self.log = log

    def copy_stream(self, device):
        stream = FakeStream(self.log)
        stream.name = "side"
        return stream


@pytest.fixture
def device_log(monkeypatch):
    """Records pinning, stream use and non-blocking copies of CPU tensors."""
    log: list = []
    module = FakeDeviceModule(log)
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: module)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: log.append(("is_pinned",)))

    def pin_memory(self, *args):
        if getattr(self, "pinned", False):  # as torch's: a pinned tensor comes back as it is
            return self
        log.append(("pin", self[0].item()))
        pinned = self.clone()
        pinned.pinned = True
        return pinned

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, stream: log.append(("used on", stream.name))
    )
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if "non_blocking" in kwargs:
            log.append(("copy", self[0].item(), kwargs["non_blocking"]))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return log


def numbers(n: int = 6, batch_size: int = 2, **kwargs) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, **kwargs)


def prepared(loader: DataLoader, log: list, **kwargs):
    return prepare_data_loader(
        loader,
        device=torch.device("cpu"),
        num_processes=1,
        process_index=0,
        put_on_device=True,
        platform=PinningPlatform(log),
        **kwargs,
    )


def test_small_batches_are_pinned_and_copied_on_the_training_stream(device_log):
    """A small batch's copy costs the GPU less than a side stream costs the host: it is
    queued on the training stream, one batch ahead, with nothing to wait for."""
    loader = prepared(numbers(), device_log)
    assert not loader.pin_memory and loader.mover.pin and loader.mover.non_blocking
    batches = iter(loader)
    first = next(batches)
    assert device_log == [("pin", 0), ("copy", 0, True), ("pin", 2), ("copy", 2, True)]
    assert first[0].tolist() == [0, 1] and loader.mover.uses_stream is False
    assert [b[0].tolist() for b in batches] == [[2, 3], [4, 5]]
    assert [event[1] for event in device_log if event[0] == "pin"] == [0, 2, 4]


def test_large_batches_are_copied_ahead_on_the_side_stream(device_log, monkeypatch):
    monkeypatch.setattr(loader_module, "SIDE_STREAM_MIN_BYTES", 16)  # 2 int64 numbers
    loader = prepared(numbers(), device_log)
    batches = iter(loader)
    first = next(batches)
    # batch 0 is copied, then batch 1 is read and its copy started on the side stream
    # before batch 0 is handed out: the training stream waits for batch 0's copy alone
    assert device_log == [
        ("on", "side"),
        ("pin", 0),
        ("copy", 0, True),
        ("recorded", "side copy 1"),
        ("on", "side"),
        ("pin", 2),
        ("copy", 2, True),
        ("recorded", "side copy 2"),
        ("wait", "side copy 1"),
        ("used on", "current"),
    ]
    assert first[0].tolist() == [0, 1] and loader.mover.uses_stream is True
    assert [b[0].tolist() for b in batches] == [[2, 3], [4, 5]]
    waits = [event for event in device_log if event[0].startswith("wait")]
    assert waits == [("wait", "side copy 1"), ("wait", "side copy 2"), ("wait", "side copy 3")]


def test_pinning_asks_no_driver_question_first(device_log):
    """pin_memory() checks by itself; an is_pinned() before it was a second driver call."""
    assert [b[0].tolist() for b in prepared(numbers(), device_log)] == [[0, 1], [2, 3], [4, 5]]
    assert ("is_pinned",) not in device_log


def test_a_loader_the_person_pinned_is_not_pinned_again(device_log):
    with pytest.warns(UserWarning, match="pin_memory"):  # a CPU build has nothing to pin for
        loader = prepared(numbers(pin_memory=True), device_log)
        assert loader.pin_memory and not loader.mover.pin
        assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert not [event for event in device_log if event[0] == "pin"]
    assert [event for event in device_log if event[0] == "copy"] == [
        ("copy", 0, True),
        ("copy", 2, True),
        ("copy", 4, True),
    ]


def test_tensors_already_pinned_or_on_the_device_are_not_pinned(device_log):
    class Pinned(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return torch.tensor([index])

    def collate(items):
        batch = torch.cat(items)
        batch.pinned = True
        return batch

    loader = prepared(DataLoader(Pinned(), batch_size=2, collate_fn=collate), device_log)
    assert [b.tolist() for b in loader] == [[0, 1]]
    assert not [event for event in device_log if event[0] == "pin"]


def test_worker_processes_pin_in_the_dataloader(device_log):
    loader = prepared(numbers(num_workers=2), device_log)
    assert loader.pin_memory and not loader.mover.pin and loader.num_workers == 2


def test_non_blocking_false_keeps_blocking_copies(device_log):
    loader = prepared(numbers(), device_log, non_blocking=False)
    assert loader.mover.stream is None and not loader.mover.pin and not loader.pin_memory
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert device_log == [("copy", 0, False), ("copy", 2, False), ("copy", 4, False)]


def test_end_of_dataloader_and_resume_hold_with_copies_ahead(device_log):
    loader = prepared(numbers(), device_log)
    ends = []
    for _ in loader:
        ends.append(loader.end_of_dataloader)
    assert ends == [False, False, True]
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    batches.close()
    loader.load_state_dict(state)
    assert [b[0].tolist() for b in loader] == [[2, 3], [4, 5]]


def test_on_the_cpu_batches_are_copied_as_before(device_log):
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(numbers())
    assert loader.mover.stream is None and not loader.mover.pin
    assert not loader.mover.non_blocking and not loader.pin_memory
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    # non_blocking=True is passed on to .to(), as Accelerate does
    config = DataLoaderConfiguration(non_blocking=True)
    loader = Accelerator(cpu=True, dataloader_config=config).prepare(numbers())
    assert loader.mover.non_blocking and loader.mover.stream is None


def test_the_accelerator_asks_its_platform(monkeypatch):
    import notebook_accel.accelerator.accelerator as accelerator_module

    seen = {}
    real = accelerator_module.prepare_data_loader

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(accelerator_module, "prepare_data_loader", spy)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(numbers())
    assert seen["platform"] is accelerator.state.platform
    assert seen["non_blocking"] is None  # the device decides


def test_a_loader_copying_on_a_side_stream_still_pickles(device_log):
    loader = prepared(numbers(), device_log)
    loader.mover.stream.lock = threading.Lock()  # like a real stream: not picklable
    copy = pickle.loads(pickle.dumps(loader.mover))
    assert copy.stream is None and copy.pin and copy.non_blocking


class CountingPlatform(CpuPlatform):
    """The CPU platform, counting the calls a prepared loader makes before each transfer
    (on XLA, each one cuts the lazy graph)."""

    def __init__(self) -> None:
        self.transfers = 0

    def before_batch_transfer(self) -> None:
        self.transfers += 1


def test_a_prepared_loader_tells_its_platform_before_each_batch_goes_to_the_device():
    platform = CountingPlatform()
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    placed = prepare_data_loader(
        loader,
        num_processes=1,
        process_index=0,
        device=torch.device("cpu"),
        put_on_device=True,
        platform=platform,
    )
    assert len(list(placed)) == 4 and platform.transfers == 4
    unplaced = prepare_data_loader(loader, num_processes=1, process_index=0, platform=platform)
    assert len(list(unplaced)) == 4 and platform.transfers == 4  # no device: no transfer
