"""The control panel: choose devices and precision, launch, watch, stop.

The panel is a view over the same launch code as `notebook_launcher`: its
choices become a `LaunchConfig`, the launch goes through `plan_launch` and
`run_plan`, and it holds no training logic of its own. `PanelChoices` is the
panel's state without widgets, so it can be tested without a browser.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from typing import Any

from notebook_accel.launch.options import OPTIONS, LaunchConfig
from notebook_accel.platforms.hardware import Hardware
from notebook_accel.platforms.registry import (
    PLATFORMS,
    detect_hardware,
    offered_platforms,
    platform_named,
)
from notebook_accel.views import format as fmt
from notebook_accel.views.state import RunView


@dataclass
class PanelChoices:
    """What the person chose, checked against the hardware."""

    hardware: Hardware
    backend: str = "cpu"
    gpus: list[int] = field(default_factory=list)
    num_processes: int = 2
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    fsdp: dict | None = None  # FSDP plugin fields; None: no sharding
    # "local" (this machine's devices) or "ray" (a Ray cluster, at `ray_address` when given).
    cluster: str = "local"
    ray_address: str = ""
    # A loaded file's other settings (restarts, timeout, port, nodes), kept as they were.
    loaded: LaunchConfig = field(default_factory=LaunchConfig)

    @classmethod
    def for_hardware(cls, hardware: Hardware) -> PanelChoices:
        backend = hardware.accelerator
        platform = platform_named(backend)
        gpus = [index for index, _ in hardware.device_choices] if platform.chooses_devices else []
        processes = len(gpus) or PLATFORMS["cpu"].default_num_processes(hardware)
        return cls(hardware, backend, gpus, max(processes, 1))

    @property
    def platform(self):
        return platform_named(self.backend)

    @property
    def on_cluster(self) -> bool:
        """Whether the workers run on a Ray cluster, whose nodes decide their devices."""
        return self.cluster == "ray"

    def backends(self) -> list[str]:
        return offered_platforms(self.hardware)

    def processes(self) -> int:
        """Workers the launch will start: one per chosen GPU, every TPU core, or as asked."""
        if self.on_cluster:
            return self.num_processes
        return self.platform.processes_for(self.hardware, self.gpus, self.num_processes)

    def precision_problems(self) -> dict[str, str | None]:
        """Each precision, with why it cannot run here (None when it can; on a cluster the
        launch checks it against the cluster's nodes)."""
        choices = OPTIONS["mixed_precision"].choices or ()
        if self.on_cluster:
            return dict.fromkeys(choices)
        return {name: self.platform.precision_problem(name, self.hardware) for name in choices}

    def problem(self) -> str | None:
        """Why Launch cannot go ahead with these choices, or None."""
        if self.processes() < 1:
            return f"choose at least one {self.platform.device_noun}"
        reason = self.precision_problems()[self.mixed_precision]
        if reason:
            return f"{self.mixed_precision}: {reason}"
        return None

    def to_config(self) -> LaunchConfig:
        if self.on_cluster:  # the cluster's nodes decide the backend: GPUs where it has them
            return dataclasses.replace(
                self.loaded,
                cluster="ray",
                ray_address=self.ray_address.strip() or None,
                backend=None,
                num_processes=self.processes(),
                devices=None,
                mixed_precision=self.mixed_precision,
                gradient_accumulation_steps=self.gradient_accumulation_steps,
                fsdp=self.fsdp,
            )
        return dataclasses.replace(
            self.loaded,
            cluster="local",
            ray_address=None,
            backend=self.backend,
            num_processes=self.processes(),
            devices=list(self.gpus) if self.platform.chooses_devices else None,
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            fsdp=self.fsdp,
        )

    def apply(self, config: LaunchConfig) -> None:
        """Take a loaded configuration's choices; raise ValueError if this machine can't."""
        if config.cluster == "ray":
            self.cluster, self.ray_address = "ray", config.ray_address or ""
            self.num_processes = config.num_processes or self.num_processes
            self.mixed_precision = config.mixed_precision
            self.gradient_accumulation_steps = config.gradient_accumulation_steps
            self.fsdp = config.fsdp
            self.loaded = config
            return
        self.cluster, self.ray_address = "local", ""
        backend = config.backend or self.backend
        if backend not in self.backends():
            raise ValueError(
                f"the configuration asks for backend {backend!r}, which this "
                f"machine does not have (it has {', '.join(self.backends())})."
            )
        problem = platform_named(backend).precision_problem(config.mixed_precision, self.hardware)
        if problem:
            raise ValueError(f"the configuration asks for {config.mixed_precision}: {problem}.")
        if platform_named(backend).chooses_devices:
            known = {index for index, _ in self.hardware.device_choices}
            gpus = (
                config.devices
                if config.devices is not None
                else sorted(known)[: config.num_processes or len(known)]
            )
            missing = [index for index in gpus if index not in known]
            if missing:
                raise ValueError(
                    f"the configuration names device {missing}, which this machine does not have."
                )
            self.gpus = list(gpus)
        elif config.num_processes is not None:
            self.num_processes = config.num_processes
        self.backend = backend
        self.mixed_precision = config.mixed_precision
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.fsdp = config.fsdp
        self.loaded = config


def hardware_summary(hardware: Hardware) -> str:
    lines = [f"CPU: {hardware.cpu_cores} cores, {fmt.size(hardware.ram_bytes)} RAM"]
    for gpu in hardware.gpus:
        capability = f", compute {gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else ""
        lines.append(f"GPU {gpu.index}: {gpu.name} ({fmt.size(gpu.memory_bytes)}{capability})")
    if hardware.tpu_cores:
        lines.append(f"TPU: {hardware.tpu_cores} cores")
    found = hardware.accelerators
    if found is not None and found.problem:
        lines.append(f"{found.device_type}: cannot be used: {found.problem}")
    elif found is not None and found.count:
        name = f" ({found.name})" if found.name else ""
        lines.append(f"{found.device_type}: {found.count} device(s){name}")
    if hardware.accelerator == "cpu":
        lines.append("No GPU or TPU: workers run on CPU cores (gloo).")
    return "<br>".join(escape(line) for line in lines)


class _PanelRun(RunView):
    """The panel's view of one run: redraws its widgets from the launch thread."""

    def __init__(self, panel: LaunchPanel) -> None:
        super().__init__()
        self.panel = panel

    def changed(self, final: bool) -> None:
        self.panel.run_widgets.refresh(self.report, force=final or not self.periodic)


class LaunchPanel:
    """An ipywidgets panel that launches `function(*args, **kwargs)` on the chosen devices.

    After a run, `result` holds the main worker's return value, `error` the
    exception (a WorkerError with the worker's traceback), and `report` the
    report of the run it started, from its start on (a launch from a cell
    meanwhile has a report of its own, which `last_run()` then gives).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        hardware: Hardware | None = None,
        config_path: str = "launch.yaml",
    ) -> None:
        import ipywidgets as w

        from notebook_accel.views.widgets import RunWidgets

        self.function, self.args, self.kwargs = function, tuple(args), dict(kwargs or {})
        self.choices = PanelChoices.for_hardware(hardware or detect_hardware())
        self.result: Any = None
        self.error: BaseException | None = None
        self.report = None
        self._thread: threading.Thread | None = None
        self._stop = None
        self._active = False
        self._attached = None  # live workers shown here (attach)
        self._detached = None  # the detached run shown here (launched detached, or attach)
        self._lock = threading.RLock()
        # What showing the panel warmed for the first launch (launch/warm.py).
        self.warming = None

        hw = self.choices.hardware
        self.hardware_view = w.HTML(hardware_summary(hw))
        self.where = w.Dropdown(
            options=[("this machine", "local"), ("a Ray cluster", "ray")],
            value=self.choices.cluster,
            description="Run on",
            tooltip=OPTIONS["cluster"].help,
            layout=w.Layout(width="220px"),
        )
        self.where.add_class("notebook-accel-cluster")
        self.ray_address = w.Text(
            value=self.choices.ray_address,
            placeholder="auto, host:6379, ray://host:10001 (empty: the kernel's Ray or a new one)",
            description="Address",
            tooltip=OPTIONS["ray_address"].help,
            layout=w.Layout(width="480px"),
        )
        self.ray_address.add_class("notebook-accel-ray-address")
        # Each field's bounds and tooltip come from the launch option it sets.
        self.backend = w.Dropdown(
            options=self.choices.backends(),
            value=self.choices.backend,
            description="Backend",
            tooltip=OPTIONS["backend"].help,
            layout=w.Layout(width="200px"),
        )
        self.gpu_boxes = [
            w.Checkbox(
                value=True,
                description=label,
                indent=False,
                layout=w.Layout(width="110px"),
            )
            for _, label in hw.device_choices
        ]
        self.processes = w.BoundedIntText(
            value=self.choices.num_processes,
            min=OPTIONS["num_processes"].minimum,
            max=256,
            description="Processes",
            tooltip=OPTIONS["num_processes"].help,
            layout=w.Layout(width="180px"),
        )
        self.processes.add_class("notebook-accel-processes")
        self.precision_buttons = {}
        for name in OPTIONS["mixed_precision"].choices or ():
            button = w.ToggleButton(
                value=name == self.choices.mixed_precision,
                description=name,
                layout=w.Layout(width="70px"),
            )
            button.add_class(f"notebook-accel-precision-{name}")
            button.observe(self._on_precision, names="value")
            self.precision_buttons[name] = button
        self.precision_note = w.HTML()
        accumulation = OPTIONS["gradient_accumulation_steps"]
        self.accumulation = w.BoundedIntText(
            value=accumulation.default,
            min=accumulation.minimum,
            max=4096,
            description="Accumulate",
            tooltip=accumulation.help,
            layout=w.Layout(width="180px"),
        )
        self.shard = w.Checkbox(
            value=False,
            description="Shard the model (FSDP2)",
            indent=False,
            tooltip=OPTIONS["fsdp"].help,
        )
        self.shard.add_class("notebook-accel-fsdp")
        self.detach_box = w.Checkbox(
            value=False,
            description="Detach: the run outlives the kernel",
            indent=False,
            tooltip="run under a process of its own; attach() from any kernel",
        )
        self.detach_box.add_class("notebook-accel-detach")
        self.launch_button = w.Button(description="Launch", button_style="primary", icon="play")
        self.launch_button.add_class("notebook-accel-launch")
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.stop_button.add_class("notebook-accel-stop")
        self.config_path = w.Text(
            value=config_path, description="Config", layout=w.Layout(width="300px")
        )
        self.save_button = w.Button(description="Save", icon="save")
        self.load_button = w.Button(description="Load", icon="folder-open")
        self.message = w.HTML()
        self.message.add_class("notebook-accel-message")
        self.run_widgets = RunWidgets(output="open")
        self.outcome = w.HTML()
        self.outcome.add_class("notebook-accel-result")

        self.where.observe(self._on_choice, names="value")
        self.ray_address.observe(self._on_choice, names="value")
        self.backend.observe(self._on_choice, names="value")
        self.processes.observe(self._on_choice, names="value")
        self.accumulation.observe(self._on_choice, names="value")
        self.shard.observe(self._on_choice, names="value")
        for box in self.gpu_boxes:
            box.observe(self._on_choice, names="value")
        self.launch_button.on_click(lambda _: self.launch())
        self.stop_button.on_click(lambda _: self.stop())
        self.save_button.on_click(lambda _: self.save_config())
        self.load_button.on_click(lambda _: self.load_config())

        self.box = w.VBox(
            [
                w.HTML("<b>notebook_accel</b>"),
                self.hardware_view,
                w.HBox([self.where, self.ray_address]),
                w.HBox([self.backend, *self.gpu_boxes, self.processes]),
                w.HBox([w.Label("Precision"), *self.precision_buttons.values()]),
                self.precision_note,
                w.HBox([self.accumulation, self.shard, self.detach_box]),
                w.HBox([self.launch_button, self.stop_button]),
                w.HBox([self.config_path, self.save_button, self.load_button]),
                self.message,
                self.run_widgets.box,
                self.outcome,
            ]
        )
        self.box.add_class("notebook-accel-panel")
        self._sync_widgets()

    # -- display -----------------------------------------------------------------

    def display(self) -> None:
        """Show the panel under the current cell."""
        from IPython.display import display

        self._warm_once()
        display(self.box)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self._warm_once()
        return self.box._repr_mimebundle_(**kwargs)

    def _warm_once(self) -> None:
        # A panel on screen means a launch is near: import now, in the background,
        # what every worker's first torch.optim optimizer would import (seconds).
        if self.warming is None:
            from notebook_accel.launch.warm import warm_known

            self.warming = warm_known(enabled=self.choices.loaded.warm)

    # -- choices -----------------------------------------------------------------

    def _on_precision(self, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            chosen = change["owner"].description
            if change["new"]:
                self.choices.mixed_precision = chosen
            elif chosen == self.choices.mixed_precision:  # a radio group: one stays pressed
                self.choices.mixed_precision = "no"
            self._sync_widgets()

    def _on_choice(self, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            self._take_choices()
            self._sync_widgets()

    def _take_choices(self) -> None:
        self.choices.cluster = self.where.value
        self.choices.ray_address = self.ray_address.value
        self.choices.backend = self.backend.value
        self.choices.gpus = [
            index
            for (index, _), box in zip(
                self.choices.hardware.device_choices, self.gpu_boxes, strict=True
            )
            if box.value
        ]
        self.choices.num_processes = self.processes.value
        self.choices.gradient_accumulation_steps = self.accumulation.value
        if self.shard.value != (self.choices.fsdp is not None):  # keep a loaded section
            self.choices.fsdp = {} if self.shard.value else None
        if self.choices.precision_problems()[self.choices.mixed_precision]:
            self.choices.mixed_precision = "no"

    # Set while _sync_widgets writes the widgets, so that the change events those
    # writes cause are not taken for the person's own choices. The lock keeps the
    # run thread's redraw and a click in the kernel's thread from interleaving.
    _syncing = False

    def _sync_widgets(self) -> None:
        """Make every widget show `self.choices`, disabling what cannot run."""
        with self._lock:
            self._write_widgets()

    def _write_widgets(self) -> None:
        self._syncing = True
        try:
            choices = self.choices
            running = self.running
            here = not choices.on_cluster
            self.where.value = choices.cluster
            self.where.disabled = running
            self.ray_address.value = choices.ray_address
            self.ray_address.layout.display = "none" if here else ""
            self.ray_address.disabled = running
            self.backend.value = choices.backend
            self.backend.layout.display = "" if here else "none"
            for (index, _), box in zip(
                choices.hardware.device_choices, self.gpu_boxes, strict=True
            ):
                box.value = index in choices.gpus
                box.layout.display = "" if here and choices.platform.chooses_devices else "none"
                box.disabled = running
            self.processes.value = choices.processes()
            free_count = choices.platform.free_process_count or not here
            self.processes.disabled = running or not free_count
            problems = choices.precision_problems()
            for name, button in self.precision_buttons.items():
                button.value = name == choices.mixed_precision
                button.disabled = running or problems[name] is not None
                button.tooltip = problems[name] or f"train in {name}"
            unavailable = [reason for reason in problems.values() if reason]
            self.precision_note.value = (
                "<small>" + "<br>".join(escape(text) for text in unavailable) + "</small>"
                if unavailable
                else ""
            )
            self.accumulation.value = choices.gradient_accumulation_steps
            self.accumulation.disabled = running
            self.shard.value = choices.fsdp is not None
            self.shard.disabled = running
            self.detach_box.disabled = running
            self.backend.disabled = running
            problem = choices.problem()
            self.launch_button.disabled = running or problem is not None
            self.launch_button.tooltip = problem or "start the workers"
            self.stop_button.disabled = not running
        finally:
            self._syncing = False

    # -- config file -------------------------------------------------------------

    def save_config(self) -> None:
        """Write the current choices to the YAML file named in the Config box."""
        try:
            self.choices.to_config().save(self.config_path.value)
        except OSError as error:
            self._say(f"Could not save: {error}", error=True)
        else:
            self._say(f"Saved to {self.config_path.value}")

    def load_config(self) -> None:
        """Take the choices from the YAML file named in the Config box."""
        try:
            self.choices.apply(LaunchConfig.load(self.config_path.value))
        except (OSError, ValueError) as error:
            self._say(f"Could not load: {error}", error=True)
        else:
            self._sync_widgets()
            self._say(f"Loaded {self.config_path.value}")

    def _say(self, text: str, error: bool = False) -> None:
        colour = "#d62728" if error else "#555"
        self.message.value = f"<span style='color:{colour}'>{escape(text)}</span>"

    # -- running -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while a run started from the panel is going, or live workers are attached."""
        return self._active or (self._attached is not None and self._attached.alive)

    def attach(self, workers: Any) -> None:
        """Show a live group's progress, loss curve and logs here (notebook_accel.live),
        or a detached run's (`attach(run_id, wait=False, live=False)`): its run so far
        and from then on, its outcome at the end, and the panel's Stop stops it.

        The panel's Stop then interrupts the group's running call and leaves the
        workers up, as the notebook's stop button does; a call that runs in a
        cell is stopped with the notebook's button, since a busy kernel handles
        widget clicks only once the cell is done. Launching waits until
        `detach()` or the group ends: the workers hold the devices.
        """
        from notebook_accel.launch.runs.detached import DetachedRun

        if isinstance(workers, DetachedRun):
            self._follow_detached(workers)
            return
        self._attached = workers
        self.report = workers.report
        workers.add_observer(_PanelRun(self))
        self.run_widgets.refresh(workers.report, force=True)
        self._say(f"attached to {workers!r}")
        self._sync_widgets()

    def detach(self) -> None:
        """Stop showing the attached live group; launching works again."""
        self._attached = None
        self._say("")
        self._sync_widgets()

    def launch(self) -> None:
        """Start a run with the current choices (in a thread, so Stop stays clickable)."""
        from notebook_accel.launch.preflight import plan_launch
        from notebook_accel.launch.running import run_plan
        from notebook_accel.launch.supervisor import StopSignal

        if self.running:
            return
        try:
            plan = plan_launch(
                function=self.function,
                args=self.args,
                kwargs=self.kwargs,
                hardware=self.choices.hardware,
                single_in_process=False,
                **self.choices.to_config().launch_options(),
            )
        except Exception as error:  # noqa: BLE001 - shown in the panel, nothing started
            self._say(str(error), error=True)
            return
        if plan.cluster is not None:
            # Here, on the kernel's thread: the run's thread must import nothing.
            from notebook_accel.launch.cluster.group import import_what_a_run_uses

            import_what_a_run_uses()
        if self.detach_box.value:
            try:
                run = _start_detached(plan)
            except Exception as error:  # noqa: BLE001 - shown in the panel
                self._say(str(error), error=True)
                return
            self._follow_detached(run)
            return
        self._detached = None
        self._say("")
        stop = self._stop = StopSignal()
        report = self.report = plan.new_report()
        view = _PanelRun(self)
        self._run_in_background(
            lambda: run_plan(plan, view, stop=stop, report=report), finally_=stop.close
        )

    def _follow_detached(self, run: Any) -> None:
        """Show a detached run here until it ends, in a thread (Stop stays clickable)."""
        if self.running:
            return
        self._say(f"detached run {run.id}: attach('{run.id}') follows it from any kernel")
        self._detached = run
        self.report = run.report
        run.add_observer(_PanelRun(self))
        self._run_in_background(run.result)

    def _run_in_background(
        self, outcome: Callable[[], Any], finally_: Callable[[], None] | None = None
    ) -> None:
        """Call `outcome` on a thread of its own (so Stop stays clickable); its value or
        error is the panel's result, shown when it returns."""
        self.result, self.error = None, None
        self.outcome.value = ""

        def run() -> None:
            try:
                self.result = outcome()
            except BaseException as error:  # noqa: BLE001 - shown in the panel
                self.error = error
            finally:
                if finally_ is not None:
                    finally_()
                self._active = False
                self._show_outcome()
                self._sync_widgets()

        self._active = True
        self._thread = threading.Thread(target=run, name="notebook_accel-panel-run", daemon=True)
        self._thread.start()
        self._sync_widgets()

    def stop(self) -> None:
        """Stop the running workers, as the kernel's stop button would (for attached live
        workers: interrupt their running call; a detached run is stopped whole)."""
        if self._detached is not None and self.running:
            # Waiting for the end blocks: not on the kernel's thread, which runs this click.
            threading.Thread(target=self._detached.stop, daemon=True).start()
            return
        if self._attached is not None:
            if self._attached.alive:
                self._attached.interrupt()
            else:
                self.detach()
            return
        if self._stop is not None and self.running:
            self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the current run to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def _show_outcome(self) -> None:
        if self.error is None:
            text = escape(repr(self.result))
            if len(text) > 2000:
                text = text[:2000] + " ..."
            self.outcome.value = f"<b>Result</b><pre>{text}</pre>"
        elif isinstance(self.error, KeyboardInterrupt):
            self.outcome.value = "<b>Stopped</b>: every worker was terminated."
        else:
            self.outcome.value = (
                f"<b style='color:#d62728'>Failed</b><pre>{escape(str(self.error))}</pre>"
            )


def _start_detached(plan: Any) -> Any:
    """Start `plan` under a keeper: a process here, or a detached actor of the cluster."""
    from notebook_accel.launch.runs.handle import start

    return start(plan)


def panel(
    function: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, **options: Any
) -> LaunchPanel:
    """A control panel for `function`: shown when it is the last expression of a cell."""
    return LaunchPanel(function, args, kwargs, **options)
