"""The panel's choices and widgets, without a browser."""

from __future__ import annotations

import time

import pytest

from notebook_accel import LaunchConfig, WorkerError
from notebook_accel.platforms import GpuInfo, Hardware
from notebook_accel.ui.panel import LaunchPanel, PanelChoices, hardware_summary
from tests_support import PROMPTLY, live_children

CPU_ONLY = Hardware(cpu_cores=2, ram_bytes=8 << 30)
TWO_T4 = Hardware(
    gpus=(GpuInfo(0, "Tesla T4", 15 << 30, (7, 5)), GpuInfo(1, "Tesla T4", 15 << 30, (7, 5))),
    cpu_cores=4,
)
FOUR_H100 = Hardware(
    gpus=tuple(GpuInfo(i, "H100", 80 << 30, (9, 0)) for i in range(4)), cpu_cores=32
)


def test_defaults_follow_the_hardware():
    cpu = PanelChoices.for_hardware(CPU_ONLY)
    assert (cpu.backend, cpu.processes(), cpu.gpus) == ("cpu", 2, [])
    gpu = PanelChoices.for_hardware(FOUR_H100)
    assert (gpu.backend, gpu.processes(), gpu.gpus) == ("cuda", 4, [0, 1, 2, 3])
    assert gpu.backends() == ["cuda", "cpu"] and cpu.backends() == ["cpu"]


def test_precisions_the_hardware_cannot_run_come_with_the_reason():
    cpu = PanelChoices.for_hardware(CPU_ONLY).precision_problems()
    assert cpu["no"] is cpu["fp16"] is cpu["bf16"] is None
    assert "CUDA GPU" in cpu["fp8"]
    t4 = PanelChoices.for_hardware(TWO_T4).precision_problems()
    assert "8.0" in t4["bf16"] and "8.9" in t4["fp8"] and t4["fp16"] is None


def test_choices_become_the_launch_configuration():
    choices = PanelChoices.for_hardware(FOUR_H100)
    choices.gpus = [1, 3]
    choices.mixed_precision = "bf16"
    choices.gradient_accumulation_steps = 4
    assert choices.to_config() == LaunchConfig(
        backend="cuda",
        num_processes=2,
        devices=[1, 3],
        mixed_precision="bf16",
        gradient_accumulation_steps=4,
    )
    choices.backend, choices.num_processes = "cpu", 3
    assert choices.to_config().devices is None and choices.to_config().num_processes == 3


def test_launch_is_refused_for_impossible_choices():
    choices = PanelChoices.for_hardware(TWO_T4)
    choices.gpus = []
    assert choices.problem() == "choose at least one GPU"
    choices.gpus = [0]
    choices.mixed_precision = "bf16"
    assert "bf16" in choices.problem()


def test_a_saved_configuration_loads_back_and_is_checked(tmp_path):
    path = tmp_path / "launch.yaml"
    choices = PanelChoices.for_hardware(FOUR_H100)
    choices.gpus, choices.mixed_precision = [0, 2], "fp16"
    choices.to_config().save(path)
    again = PanelChoices.for_hardware(FOUR_H100)
    again.apply(LaunchConfig.load(path))
    assert (again.gpus, again.mixed_precision) == ([0, 2], "fp16")
    on_a_laptop = PanelChoices.for_hardware(CPU_ONLY)
    with pytest.raises(ValueError, match="backend 'cuda', which this machine does not have"):
        on_a_laptop.apply(LaunchConfig.load(path))


def test_hardware_summary_names_each_gpu():
    text = hardware_summary(TWO_T4)
    assert "GPU 1: Tesla T4 (15.0 GB, compute 7.5)" in text and "4 cores" in text
    assert "No GPU or TPU" in hardware_summary(CPU_ONLY)


def test_widgets_disable_what_cannot_run_and_follow_clicks():
    panel = LaunchPanel(lambda: None, hardware=TWO_T4)
    assert panel.precision_buttons["bf16"].disabled
    assert "8.0" in panel.precision_buttons["bf16"].tooltip
    assert not panel.precision_buttons["fp16"].disabled
    panel.precision_buttons["fp16"].value = True
    assert panel.choices.mixed_precision == "fp16"
    assert not panel.precision_buttons["no"].value  # one precision at a time
    panel.gpu_boxes[1].value = False
    assert panel.choices.gpus == [0] and panel.processes.value == 1
    panel.gpu_boxes[0].value = False
    assert panel.launch_button.disabled and panel.launch_button.tooltip == "choose at least one GPU"


def test_save_and_load_buttons_round_trip_through_yaml(tmp_path):
    panel = LaunchPanel(lambda: None, hardware=CPU_ONLY, config_path=str(tmp_path / "a.yaml"))
    panel.processes.value = 3
    panel.precision_buttons["bf16"].value = True
    panel.save_config()
    assert "Saved" in panel.message.value
    other = LaunchPanel(lambda: None, hardware=CPU_ONLY, config_path=str(tmp_path / "a.yaml"))
    other.load_config()
    assert other.processes.value == 3 and other.precision_buttons["bf16"].value
    other.config_path.value = str(tmp_path / "missing.yaml")
    other.load_config()
    assert "Could not load" in other.message.value and "missing.yaml" in other.message.value


def precision_and_log(steps):
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    print("running in", accelerator.mixed_precision)
    for step in range(steps):
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(0.01)
    return accelerator.mixed_precision


def test_launch_from_the_panel_runs_workers_and_shows_the_run():
    panel = LaunchPanel(precision_and_log, args=(20,), hardware=CPU_ONLY)
    panel.precision_buttons["bf16"].value = True
    panel.launch()
    assert panel.running and panel.stop_button.disabled is False
    assert panel.wait(60)
    assert panel.result == "bf16" and panel.error is None
    assert panel.report.status == "finished" and len(panel.report.metrics) == 20
    logs = panel.run_widgets.logs.value
    assert "running in bf16" in logs and "[rank 1] running in bf16" in logs
    assert "<polyline" in panel.run_widgets.chart.value
    assert "finished" in panel.run_widgets.ranks.value
    # The progress line follows the logged steps (no progress bar here) to the end.
    assert panel.run_widgets.bar_label.value.startswith("finished at step 19 · ")
    assert panel.run_widgets.bar.value == panel.run_widgets.bar.max
    assert "Result" in panel.outcome.value and not panel.launch_button.disabled


def sleeps_forever():
    time.sleep(600)


def test_stop_ends_the_run_quickly_and_the_next_launch_works():
    panel = LaunchPanel(sleeps_forever, hardware=CPU_ONLY)
    panel.launch()
    time.sleep(0.5)
    panel.stop()
    assert panel.wait(PROMPTLY)  # the workers would sleep for 600 s
    assert live_children() == []
    assert panel.report.status == "stopped" and "Stopped" in panel.outcome.value
    assert "stopped" in panel.run_widgets.ranks.value
    assert panel.run_widgets.bar_label.value.startswith("stopped before the first step")
    panel.function = precision_and_log
    panel.args = (2,)
    panel.launch()
    assert panel.wait(60) and panel.result == "no"
    # The next run's line and bar are its own, not the stopped run's.
    assert panel.run_widgets.bar_label.value.startswith("finished at step 1 · ")
    assert panel.run_widgets.bar.bar_style == "success"


def fails_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank one broke")
    time.sleep(600)


def test_a_failed_run_shows_the_worker_traceback():
    panel = LaunchPanel(fails_on_rank_one, hardware=CPU_ONLY)
    panel.launch()
    assert panel.wait(30)
    assert isinstance(panel.error, WorkerError)
    assert "ValueError: rank one broke" in panel.outcome.value
    assert "failed" in panel.run_widgets.ranks.value
    assert panel.run_widgets.bar_label.value.startswith("failed before the first step · ")
    assert panel.run_widgets.bar.bar_style == "danger"


def test_bad_arguments_are_shown_in_the_panel_and_nothing_starts():
    panel = LaunchPanel(precision_and_log, args=(), hardware=CPU_ONLY)
    panel.launch()
    assert not panel.running and "cannot be called" in panel.message.value
    assert live_children() == []


def test_a_loaded_file_keeps_the_settings_the_panel_does_not_show(tmp_path):
    path = tmp_path / "launch.yaml"
    LaunchConfig(
        backend="cpu", num_processes=2, max_restarts=2, timeout=600.0, use_port=29600
    ).save(path)
    panel = LaunchPanel(lambda: None, hardware=CPU_ONLY, config_path=str(path))
    panel.load_config()
    panel.precision_buttons["bf16"].value = True
    panel.save_config()
    again = LaunchConfig.load(path)
    assert (again.max_restarts, again.timeout, again.use_port) == (2, 600.0, 29600)
    assert again.mixed_precision == "bf16"


def test_a_tpu_runtime_is_offered_with_every_core():
    tpu = Hardware(tpu_cores=8, cpu_cores=96)
    choices = PanelChoices.for_hardware(tpu)
    assert choices.backends() == ["xla", "cpu"]
    assert (choices.backend, choices.processes()) == ("xla", 8)
    assert choices.precision_problems()["fp16"] is not None  # TPUs compute in bf16


def test_a_view_on_the_second_machine_lists_that_machines_ranks():
    from notebook_accel.reporting.events import AttemptStarted
    from notebook_accel.reporting.report import RunReport
    from notebook_accel.views.widgets import ranks_html

    report = RunReport(main_rank=2)  # node 1 of 2, two workers each
    report.apply(AttemptStarted(workers=2, attempt=0))
    assert sorted(report.statuses) == [2, 3]
    assert "rank 2: running" in ranks_html(report) and "rank 0" not in ranks_html(report)


def test_a_ray_cluster_is_a_choice_of_the_panel_and_of_its_file(tmp_path):
    panel = LaunchPanel(sleeps_forever, hardware=TWO_T4)
    assert panel.ray_address.layout.display == "none"
    panel.where.value = "ray"
    panel.ray_address.value = "ray://head:10001"
    panel.processes.value = 8
    # The cluster's nodes decide the devices: no local backend or GPU boxes, any count.
    assert panel.ray_address.layout.display == ""
    assert panel.backend.layout.display == "none"
    assert all(box.layout.display == "none" for box in panel.gpu_boxes)
    assert not panel.processes.disabled
    assert not panel.precision_buttons["bf16"].disabled  # checked against the nodes
    assert panel.choices.to_config() == LaunchConfig(
        cluster="ray", ray_address="ray://head:10001", num_processes=8
    )
    path = tmp_path / "launch.yaml"
    panel.config_path.value = str(path)
    panel.save_config()
    again = LaunchPanel(sleeps_forever, hardware=CPU_ONLY, config_path=str(path))
    again.load_config()
    assert again.where.value == "ray" and again.ray_address.value == "ray://head:10001"
    assert again.choices.to_config() == panel.choices.to_config()
    again.where.value = "local"  # back to this machine: its own checks again
    assert again.choices.to_config().cluster == "local"
    assert again.choices.to_config().ray_address is None


def test_a_detached_run_from_the_panel_shows_here_and_stops_from_the_panel(runs_dir):
    from notebook_accel import attach

    panel = LaunchPanel(precision_and_log, args=(5,), hardware=CPU_ONLY)
    panel.detach_box.value = True
    panel.launch()
    assert panel.running and panel.detach_box.disabled
    assert panel.wait(PROMPTLY)
    assert panel.result == "no" and panel.error is None and "Result" in panel.outcome.value
    assert "[rank 1] running in no" in panel.run_widgets.logs.value
    assert attach(live=False) == "no"  # the run outlives the panel's kernel: any finds it

    panel.function = sleeps_forever
    panel.args = ()
    panel.launch()
    run = panel._detached
    other = LaunchPanel(sleeps_forever, hardware=CPU_ONLY)  # another kernel's panel
    other.attach(attach(run.id, wait=False, live=False))
    assert other.running
    other.stop()
    assert panel.wait(PROMPTLY) and other.wait(PROMPTLY)
    for shown in (panel, other):
        assert shown.report.status == "stopped" and "Stopped" in shown.outcome.value
