"""Experiment trackers: log_with, init_trackers, get_tracker, log, end_training.

TensorBoard for real (its event files read back with TensorBoard's own
reader); the other libraries through stand-in modules that record the calls
(their packages are not dev dependencies); custom GeneralTracker objects.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from notebook_accel import Accelerator, GeneralTracker
from notebook_accel.accelerator import tracking
from notebook_accel.accelerator.tracking import TRACKERS, TensorBoardTracker
from notebook_accel.platforms import probes
from notebook_accel.reporting import metrics
from notebook_accel.tracking import register_tracker_class
from tests_support import dev_dependency

dev_dependency("tensorboard")


def _scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


def test_tensorboard_writes_events_that_tensorboard_reads_back(tmp_path):
    metrics.clear_local_history()
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.5, "layers": [1, 2]})
    accelerator.log({"loss": 2.0, "accuracy": torch.tensor(0.25), "note": "hi"}, step=1)
    accelerator.log({"loss": 1.5, "per_class": {"a": 1.0, "b": 2.0}}, step=2)
    tracker = accelerator.get_tracker("tensorboard")
    assert isinstance(tracker, TensorBoardTracker)
    assert type(accelerator.get_tracker("tensorboard", unwrap=True)).__name__ == "SummaryWriter"
    accelerator.end_training()

    scalars = _scalars(tmp_path / "run")
    assert scalars["loss"] == [(1, 2.0), (2, 1.5)]
    assert scalars["accuracy"] == [(1, 0.25)]
    assert "lr: 0.5" in (tmp_path / "run" / "hparams.yml").read_text()
    # the notebook's live view got what it can show: not the dict of scalars
    shown = [r.values for r in metrics.local_history()]
    assert shown == [{"loss": 2.0, "accuracy": 0.25, "note": "hi"}, {"loss": 1.5}]
    assert accelerator.trackers == []  # finished


def test_all_starts_every_installed_tracker_and_no_other(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="all", project_dir=tmp_path)
    installed = [n for n, cls in TRACKERS.items() if probes.package_available(cls.package)]
    assert accelerator.log_with == installed
    assert "tensorboard" in installed


def test_a_named_tracker_whose_package_is_missing_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "package_available", lambda name: name != "wandb")
    extra = re.escape("pip install 'notebook-accel[trackers]'")
    with pytest.raises(ImportError, match=f"needs the wandb package.*pip install wandb.*{extra}"):
        Accelerator(cpu=True, log_with=["tensorboard", "wandb"], project_dir=tmp_path)


def test_bad_log_with_says_what_to_pass():
    with pytest.raises(ValueError, match="name trackers among all, tensorboard, wandb"):
        Accelerator(cpu=True, log_with="tensorbored")
    with pytest.raises(ValueError, match="pass Accelerator\\(project_dir=...\\)"):
        Accelerator(cpu=True, log_with="tensorboard")


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append("start")

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append("finish")


def test_a_custom_tracker_gets_every_call_with_its_log_kwargs():
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder])
    accelerator.init_trackers("p", config={"a": 1})
    accelerator.log({"x": 1.0}, step=3, log_kwargs={"recorder": {"commit": False}})
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    accelerator.end_training()
    assert recorder.calls == [
        "start",
        ("config", {"a": 1}),
        ("log", {"x": 1.0}, 3, {"commit": False}),
        "finish",
    ]
    with pytest.raises(ValueError, match="no tracker called 'wandb' was started"):
        accelerator.init_trackers("again")
        accelerator.get_tracker("wandb")


def test_a_tracker_class_without_its_attributes_is_refused():
    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError, match="name, requires_logging_directory, tracker"):
        Incomplete()


@pytest.fixture
def registry():
    """The tracker registry, put back as it was after the test."""
    before = dict(TRACKERS)
    yield TRACKERS
    TRACKERS.clear()
    TRACKERS.update(before)


def test_a_registered_tracker_class_is_named_in_log_with_like_a_built_in(registry, tmp_path):
    made = []

    class Registered(Recorder):
        name = "registered"

        def __init__(self, run_name, logging_dir, **kwargs):
            super().__init__()
            made.append((run_name, logging_dir, kwargs))

    class NoDir(Recorder):
        name = "no_dir"

        def __init__(self, run_name):
            super().__init__()
            made.append((run_name,))

    Registered.requires_logging_directory = True
    register_tracker_class(Registered)
    register_tracker_class(NoDir)
    with pytest.raises(ValueError, match="`registered` requires a `logging_dir`"):
        Accelerator(cpu=True, log_with="registered")
    accelerator = Accelerator(cpu=True, log_with=["registered", "no_dir"], project_dir=tmp_path)
    accelerator.init_trackers("proj", config={"a": 1}, init_kwargs={"registered": {"k": 2}})
    accelerator.log({"x": 1.0}, step=0)
    tracker = accelerator.get_tracker("registered")
    accelerator.end_training()
    assert made == [("proj", str(tmp_path), {"k": 2}), ("proj",)]
    assert tracker.calls == ["start", ("config", {"a": 1}), ("log", {"x": 1.0}, 0, {}), "finish"]
    assert "registered" not in tracking.get_available_trackers()  # "all" is the built-ins


def test_register_tracker_class_refuses_what_is_not_a_tracker_class(registry):
    with pytest.raises(ValueError, match="pass a subclass of"):
        register_tracker_class(dict)
    with pytest.raises(ValueError, match="pass a subclass of"):
        register_tracker_class(Recorder())

    class Nameless(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(ValueError, match="set the class attribute `name`"):
        register_tracker_class(Nameless)

    class NoFlag(GeneralTracker):
        name = "no_flag"

    with pytest.raises(ValueError, match="requires_logging_directory"):
        register_tracker_class(NoFlag)
    assert "no_flag" not in registry


def test_registering_a_taken_name_replaces_the_class_with_a_warning(registry):
    class Shadow(Recorder):
        name = "tensorboard"

    with pytest.warns(UserWarning, match="'tensorboard' is registered already"):
        register_tracker_class(Shadow)
    assert registry["tensorboard"] is Shadow
    assert tracking.LOGGER_TYPE_TO_CLASS is TRACKERS  # Accelerate's name for the registry


def _fake_module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(probes, "package_available", lambda n: n in sys.modules or n == "torch")
    return module


def test_wandb_and_mlflow_go_through_the_same_interface(monkeypatch):
    calls = []

    class Run:
        config = types.SimpleNamespace(update=lambda values, **k: calls.append(("config", values)))

        def log(self, values, step=None):
            calls.append(("wandb.log", values, step))

        def finish(self):
            calls.append("wandb.finish")

    def init(project, **kwargs):
        calls.append(("wandb.init", project, kwargs))
        return Run()

    _fake_module(monkeypatch, "wandb", init=init)
    _fake_module(
        monkeypatch,
        "mlflow",
        set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
        start_run=lambda **k: calls.append("mlflow.start") or "run",
        log_params=lambda values: calls.append(("mlflow.params", values)),
        log_metrics=lambda values, step=None: calls.append(("mlflow.metrics", values, step)),
        end_run=lambda: calls.append("mlflow.end"),
    )
    accelerator = Accelerator(cpu=True, log_with=["wandb", "mlflow"])
    accelerator.init_trackers("proj", {"lr": 1}, init_kwargs={"wandb": {"tags": ["t"]}})
    accelerator.log({"loss": torch.tensor(0.5), "note": "x"}, step=4)
    accelerator.end_training()
    assert calls == [
        ("wandb.init", "proj", {"tags": ["t"]}),
        ("mlflow.experiment", "proj"),
        "mlflow.start",
        ("config", {"lr": 1}),
        ("mlflow.params", {"lr": "1"}),
        ("wandb.log", {"loss": torch.tensor(0.5), "note": "x"}, 4),
        ("mlflow.metrics", {"loss": 0.5}, 4),
        "wandb.finish",
        "mlflow.end",
    ]


def _trackers_in_two_workers(project: str) -> dict:
    import torch.distributed as dist

    accelerator = Accelerator(log_with="tensorboard", project_dir=project)
    accelerator.init_trackers("run")
    accelerator.log({"rank_seen": float(accelerator.process_index)}, step=0)
    blank = type(accelerator.get_tracker("tensorboard")) is GeneralTracker
    accelerator.end_training()
    return {"blank": blank, "group_kept": dist.is_initialized()}


def test_only_the_main_process_tracks_and_the_launch_keeps_its_process_group(tmp_path):
    from notebook_accel import notebook_launcher

    results = notebook_launcher(
        _trackers_in_two_workers,
        args=(str(tmp_path),),
        num_processes=2,
        backend="cpu",
        return_all=True,
        timeout=100,
    )
    assert results == [
        {"blank": False, "group_kept": True},
        {"blank": True, "group_kept": True},
    ]
    assert _scalars(tmp_path / "run") == {"rank_seen": [(0, 0.0)]}


SCRIPT = """
import torch.distributed as dist
from notebook_accel import Accelerator

accelerator = Accelerator(log_with="tensorboard", project_dir="logs")
accelerator.init_trackers("script")
accelerator.log({"loss": 1.0}, step=0)
accelerator.end_training()
with open(f"rank{accelerator.process_index}.txt", "w") as out:
    out.write(f"group left {not dist.is_initialized()}")
"""


def test_in_a_launched_script_end_training_leaves_the_process_group(tmp_path):
    import os
    import subprocess

    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "notebook_accel.cli", "launch", "--num-processes", "2", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "NOTEBOOK_ACCEL_BACKEND": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "group left True"
    assert _scalars(tmp_path / "logs" / "script") == {"loss": [(0, 1.0)]}


def test_all_with_no_tracker_installed_warns_and_logs_to_the_notebook_only(monkeypatch):
    monkeypatch.setattr(probes, "package_available", lambda name: False)
    with pytest.warns(UserWarning, match="starts no tracker: none is installed"):
        accelerator = Accelerator(cpu=True, log_with="all")
    accelerator.init_trackers("p")
    assert accelerator.trackers == []
