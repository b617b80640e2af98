"""Experiment trackers behind `Accelerator(log_with=...)`, with Accelerate's names.

One class per tracking library, each importing its library only when a run
starts (`start()`), so naming a tracker costs nothing until `init_trackers`.
`Trackers` is what an Accelerator owns: which trackers were asked for, the
started ones, and the calls the Accelerator hands on to them. The Accelerator
uses it on the main process only, as Accelerate does; `accelerator.log` also
keeps feeding the notebook's live view (`notebook_accel.reporting.metrics`).

A custom tracker subclasses `GeneralTracker` and sets `name`,
`requires_logging_directory` and a `tracker` property; passed to `log_with` as an
object, or registered with `register_tracker_class` and then named like a built-in.
"""

from __future__ import annotations

import importlib
import os
import time
import warnings
from enum import Enum
from typing import Any

from notebook_accel.platforms import probes


class LoggerType(str, Enum):
    """The trackers `log_with` can name ("all": every one whose package is installed)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        return self.value


class GeneralTracker:
    """Base of every tracker: `start`, `store_init_configuration`, `log`, `finish`.

    A subclass sets `name` (what `log_with` and `get_tracker` call it),
    `requires_logging_directory` (its constructor then takes the Accelerator's
    logging directory after the run name) and a `tracker` property (the
    library's own run object). `main_process_only = False` makes the
    Accelerator create it on every process instead of the main one only.
    """

    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [
            attribute
            for attribute in ("name", "requires_logging_directory", "tracker")
            if not hasattr(type(self), attribute)
        ]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} must define {', '.join(missing)} to be a tracker "
                "(see notebook_accel.tracking.GeneralTracker)."
            )

    def start(self) -> None:
        """Open the run (the library is imported here, not when the tracker is named)."""

    def store_init_configuration(self, values: dict) -> None:
        """Record the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Record `values` (name -> number or text) at `step`."""

    def finish(self) -> None:
        """Close the run and flush what it holds."""


def _require(package: str, pip_name: str, tracker: str) -> None:
    if not probes.package_available(package):
        raise ImportError(
            f"log_with={tracker!r} needs the {pip_name} package, which is not installed: "
            f"pip install {pip_name} (or pip install 'notebook-accel[trackers]' for every "
            f"tracker), or leave {tracker!r} out of log_with."
        )


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files under `logging_dir/run_name` (torch.utils.tensorboard)."""

    name = "tensorboard"
    package, pip_name = "tensorboard", "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The `SummaryWriter`."""
        return self.writer

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        import yaml

        plain = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()
        }
        # add_hparams writes a run of its own in a subdirectory, as TensorBoard's HParams tab wants
        self.writer.add_hparams(plain, metric_dict={}, run_name=str(time.time()))
        self.writer.flush()
        with open(os.path.join(self.logging_dir, "hparams.yml"), "w") as file:
            yaml.safe_dump(plain, file)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for name, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(name, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(name, value, global_step=step, **kwargs)
            else:
                self.writer.add_scalar(name, _number(value), global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _ProjectRunTracker(GeneralTracker):
    """A run opened by `<package>.init(project=run_name, **init_kwargs)` that has
    `log` and `finish` (wandb, trackio and SwanLab share this interface)."""

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.run = run_name, kwargs, None

    @property
    def tracker(self) -> Any:
        """The library's run."""
        return self.run

    def start(self) -> None:
        library = importlib.import_module(self.package)
        self.run = library.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        importlib.import_module(self.package).config.update(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_ProjectRunTracker):
    """A Weights & Biases run (`wandb.init(project=run_name, **init_kwargs)`)."""

    name = "wandb"
    package, pip_name = "wandb", "wandb"

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)


class TrackioTracker(_ProjectRunTracker):
    """A trackio run (`trackio.init(project=run_name, **init_kwargs)`)."""

    name = "trackio"
    package, pip_name = "trackio", "trackio"


class CometMLTracker(GeneralTracker):
    """A Comet experiment (`comet_ml.start(project_name=run_name, **init_kwargs)`)."""

    name = "comet_ml"
    package, pip_name = "comet_ml", "comet-ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.experiment = run_name, kwargs, None

    @property
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.experiment

    def start(self) -> None:
        import comet_ml

        self.experiment = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.experiment.log_parameters(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.experiment.set_step(step)
        for name, value in values.items():
            if isinstance(value, str):
                self.experiment.log_other(name, value, **kwargs)
            elif isinstance(value, dict):
                self.experiment.log_metrics(value, step=step, **kwargs)
            else:
                self.experiment.log_metric(name, _number(value), step=step, **kwargs)

    def finish(self) -> None:
        self.experiment.end()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at `logging_dir`."""

    name = "aim"
    package, pip_name = "aim", "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.logging_dir = run_name, os.fspath(logging_dir)
        self.init_kwargs, self.run = kwargs, None

    @property
    def tracker(self) -> Any:
        """The Aim run."""
        return self.run

    def start(self) -> None:
        from aim import Run

        self.run = Run(repo=self.logging_dir, **self.init_kwargs)
        self.run.name = self.run_name

    def store_init_configuration(self, values: dict) -> None:
        self.run["hparams"] = values

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        for name, value in values.items():
            self.run.track(value, name=name, step=step, **kwargs)

    def finish(self) -> None:
        self.run.close()


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment `run_name` (or `MLFLOW_EXPERIMENT_NAME`)."""

    name = "mlflow"
    package, pip_name = "mlflow", "mlflow"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", run_name)
        self.init_kwargs, self.active_run = kwargs, None

    @property
    def tracker(self) -> Any:
        """The active MLflow run."""
        return self.active_run

    def start(self) -> None:
        import mlflow

        mlflow.set_experiment(self.experiment_name)
        self.active_run = mlflow.start_run(**self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        mlflow.log_params({k: str(v) for k, v in values.items()})

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        numbers = {k: _number(v) for k, v in values.items() if not isinstance(v, (str, dict))}
        mlflow.log_metrics(numbers, step=step, **kwargs)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """A ClearML task (`Task.init(project_name=run_name, **init_kwargs)`)."""

    name = "clearml"
    package, pip_name = "clearml", "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.init_kwargs, self.task = run_name, kwargs, None

    @property
    def tracker(self) -> Any:
        """The ClearML task."""
        return self.task

    def start(self) -> None:
        from clearml import Task

        kwargs = {"project_name": self.run_name, "task_name": self.run_name}
        self.task = Task.init(**{**kwargs, **self.init_kwargs})

    def store_init_configuration(self, values: dict) -> None:
        self.task.connect_configuration(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        logger = self.task.get_logger()
        for name, value in values.items():
            if isinstance(value, str):
                continue  # ClearML's scalar plots hold numbers only
            title, _, series = name.rpartition("/")
            if step is None:
                logger.report_single_value(name=name, value=_number(value), **kwargs)
            else:
                logger.report_scalar(
                    title=title or series,
                    series=series,
                    value=_number(value),
                    iteration=step,
                    **kwargs,
                )

    def finish(self) -> None:
        self.task.close()


class DVCLiveTracker(GeneralTracker):
    """A DVCLive `Live` (`live=` passes one already made)."""

    name = "dvclive"
    package, pip_name = "dvclive", "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.live, self.init_kwargs = live, kwargs

    @property
    def tracker(self) -> Any:
        """The `Live` object."""
        return self.live

    def start(self) -> None:
        if self.live is None:
            from dvclive import Live

            self.live = Live(**self.init_kwargs)

    def store_init_configuration(self, values: dict) -> None:
        self.live.log_params(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        for name, value in values.items():
            if not isinstance(value, (str, dict)):
                self.live.log_metric(name, _number(value), **kwargs)
        self.live.next_step()

    def finish(self) -> None:
        self.live.end()


class SwanLabTracker(_ProjectRunTracker):
    """A SwanLab run (`swanlab.init(project=run_name, **init_kwargs)`)."""

    name = "swanlab"
    package, pip_name = "swanlab", "swanlab"


# name -> class, for log_with; register_tracker_class adds to it (Accelerate's
# LOGGER_TYPE_TO_CLASS, the same dict)
TRACKERS: dict[str, type[GeneralTracker]] = {
    cls.name: cls
    for cls in (
        TensorBoardTracker,
        WandBTracker,
        TrackioTracker,
        CometMLTracker,
        AimTracker,
        MLflowTracker,
        ClearMLTracker,
        DVCLiveTracker,
        SwanLabTracker,
    )
}


LOGGER_TYPE_TO_CLASS = TRACKERS


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a `GeneralTracker` subclass nameable in `log_with` by its `name`, as a built-in.

    Register it before making the Accelerator that names it. `init_trackers`
    makes it as `tracker_class(project_name, **init_kwargs[name])`, with the
    Accelerator's logging directory after the project name when the class sets
    `requires_logging_directory = True`. Registering a name again replaces the
    class, with a warning.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(
            f"register_tracker_class got {tracker_class!r}: pass a subclass of "
            "notebook_accel.tracking.GeneralTracker (the class, not an object)."
        )
    name = getattr(tracker_class, "name", None)
    if not name:
        raise ValueError(
            f"{tracker_class.__name__} has no name: set the class attribute `name`, the word "
            "log_with will use for it."
        )
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(
            f"{tracker_class.__name__} must set the class attribute "
            "`requires_logging_directory`: True if its constructor takes the logging "
            "directory after the run name, False otherwise."
        )
    if name in TRACKERS:
        warnings.warn(
            f"A tracker named '{name}' is registered already ({TRACKERS[name].__name__}); "
            f"{tracker_class.__name__} replaces it for log_with={name!r}.",
            UserWarning,
            stacklevel=2,
        )
    TRACKERS[name] = tracker_class


def get_available_trackers() -> list[str]:
    """The built-in trackers whose package is installed (what `log_with="all"` starts)."""
    return [
        name
        for name, cls in TRACKERS.items()
        if getattr(cls, "package", None) and probes.package_available(cls.package)
    ]


def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def _names(log_with: Any) -> list[Any]:
    if log_with is None:
        return []
    return list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]


class Trackers:
    """The trackers of one Accelerator: those asked for, then those started."""

    def __init__(self, log_with: Any, logging_dir: str | None) -> None:
        """Check `log_with` now, so a bad name or a missing package fails before training."""
        wanted: list[str | GeneralTracker] = []
        for item in _names(log_with):
            if isinstance(item, GeneralTracker):
                wanted.append(item)
            elif str(getattr(item, "value", item)) == "all":
                wanted.extend(get_available_trackers())
            elif str(getattr(item, "value", item)) in TRACKERS:
                name = str(getattr(item, "value", item))
                if getattr(TRACKERS[name], "package", None):  # a registered class may have none
                    _require(TRACKERS[name].package, TRACKERS[name].pip_name, name)
                wanted.append(name)
            else:
                raise ValueError(
                    f"log_with got {item!r}; name trackers among "
                    f"{', '.join(['all', *TRACKERS])}, pass GeneralTracker objects, or "
                    "register your class with register_tracker_class first."
                )
        needs_dir = [
            w for w in wanted if isinstance(w, str) and TRACKERS[w].requires_logging_directory
        ]
        if needs_dir and logging_dir is None:
            # Accelerate's first sentence, which code matches on; then the way out.
            raise ValueError(
                f"Logging with `{needs_dir[0]}` requires a `logging_dir` to be passed in: "
                "pass Accelerator(project_dir=...) or a ProjectConfiguration with logging_dir."
            )
        if log_with is not None and not wanted:
            warnings.warn(
                f"log_with={log_with!r} starts no tracker: none is installed (pip install "
                "tensorboard, for one). accelerator.log still reaches the notebook.",
                stacklevel=3,
            )
        self.log_with = list(dict.fromkeys(wanted))  # "all" next to a named one: once
        self.logging_dir = logging_dir
        self.started: list[GeneralTracker] = []

    def init(self, project_name: str, config: dict | None, init_kwargs: dict | None) -> None:
        """Create and start each tracker for `project_name`; store `config` in each."""
        init_kwargs = init_kwargs or {}
        for item in self.log_with:
            if isinstance(item, GeneralTracker):
                tracker = item
            else:
                cls, kwargs = TRACKERS[item], init_kwargs.get(item, {})
                if cls.requires_logging_directory:
                    tracker = cls(project_name, self.logging_dir, **kwargs)
                else:
                    tracker = cls(project_name, **kwargs)
            self.started.append(tracker)
        for tracker in self.started:
            tracker.start()
        if config is not None:
            for tracker in self.started:
                tracker.store_init_configuration(config)

    def log(self, values: dict, step: int | None, log_kwargs: dict | None) -> None:
        """Hand `values` to every started tracker (`log_kwargs`: tracker name -> kwargs)."""
        for tracker in self.started:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (its library object with `unwrap`)."""
        if (
            not self.started
        ):  # not the main process, or nothing started: a tracker that does nothing
            return GeneralTracker(_blank=True)
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"no tracker called {name!r} was started; the started ones are "
            f"{', '.join(t.name for t in self.started)}."
        )

    def finish(self) -> None:
        """Close every started tracker, once."""
        started, self.started = self.started, []
        for tracker in started:
            tracker.finish()


__all__ = [
    "GeneralTracker",
    "LOGGER_TYPE_TO_CLASS",
    "LoggerType",
    "TRACKERS",
    "Trackers",
    "get_available_trackers",
    "register_tracker_class",
    *(cls.__name__ for cls in TRACKERS.values()),
]
