"""Metrics, progress and memory figures travel from the workers to the kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from notebook_accel import Accelerator, last_run, notebook_launcher, progress_bar
from notebook_accel.reporting.metrics import MetricRecord
from notebook_accel.reporting.observers import RunObserver

# Every test here runs with forked workers and with workers that get the function by
# value (tests/conftest.py says why not a third time under "spawn").
pytestmark = pytest.mark.usefixtures("each_way_to_ship")


def logs_steps(steps, every_rank=False):
    accelerator = Accelerator()
    for step in progress_bar(range(steps)):
        accelerator.log(
            {"loss": torch.tensor(1.0 / (step + 1)), "phase": "train"},
            step=step,
            main_process_only=not every_rank,
        )
    return steps


class Arrivals(RunObserver):
    """Records when each metric arrives, to prove they stream during the run."""

    def __init__(self):
        self.metrics: list[tuple[float, MetricRecord]] = []

    def on_event(self, event, report):
        if isinstance(event, MetricRecord):
            self.metrics.append((time.monotonic(), event))


def slow_logger():
    accelerator = Accelerator()
    for step in range(5):
        accelerator.log({"loss": float(step)}, step=step)
        time.sleep(0.2)


def test_metrics_arrive_while_the_run_goes():
    arrivals = Arrivals()
    notebook_launcher(slow_logger, num_processes=2, observers=[arrivals], live=False, backend="cpu")
    ended = time.monotonic()
    times = [when for when, _ in arrivals.metrics]
    assert len(times) == 5
    assert ended - times[0] > 0.6  # the first record came long before the end


def test_history_is_data_after_the_run():
    notebook_launcher(logs_steps, args=(30,), num_processes=2, live=False, backend="cpu")
    report = last_run()
    assert len(report.metrics) == 30  # main process only, as in Accelerate
    assert {record.rank for record in report.metrics} == {0}
    assert report.history("loss")[:2] == [(0, 1.0), (1, 0.5)]
    assert report.metrics[0].values["phase"] == "train"
    assert report.progress == {"step": 30, "total": 30, "elapsed": report.progress["elapsed"]}
    for rank in (0, 1):
        assert report.resources[rank]["peak_rss_bytes"] > 10 << 20


def test_every_rank_can_log_when_asked():
    notebook_launcher(
        logs_steps,
        args=(4,),
        kwargs={"every_rank": True},
        num_processes=2,
        live=False,
        backend="cpu",
    )
    assert sorted(record.rank for record in last_run().metrics) == [0] * 4 + [1] * 4
    assert len(last_run().history("loss", rank=1)) == 4


def test_metrics_from_a_single_in_process_run_are_kept_too():
    notebook_launcher(logs_steps, args=(3,), num_processes=1, live=False, backend="cpu")
    assert [step for step, _ in last_run().history("loss")] == [0, 1, 2]
    assert last_run().progress["step"] == 3


def test_dataframe_needs_pandas_or_says_how_to_get_it():
    notebook_launcher(logs_steps, args=(2,), num_processes=2, live=False, backend="cpu")
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            last_run().to_dataframe()
    else:
        frame = last_run().to_dataframe()
        assert list(frame["step"]) == [0, 1] and list(frame["loss"]) == [1.0, 0.5]


def logs_a_list():
    Accelerator().log({"loss": [1, 2]})


def test_a_value_that_is_not_a_number_is_a_clear_error():
    from notebook_accel import WorkerError

    with pytest.raises(WorkerError, match="log numbers, one-element tensors or strings"):
        notebook_launcher(logs_a_list, num_processes=2, live=False, backend="cpu")


SCRIPT = textwrap.dedent("""
    import time
    from notebook_accel import Accelerator, notebook_launcher, progress_bar

    def train():
        accelerator = Accelerator()
        for step in progress_bar(range(25)):
            accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.1)

    notebook_launcher(train, num_processes=2, backend="cpu")
""")


def test_a_script_shows_progress_and_memory_as_text(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[notebook_accel]")]
    assert any("it/s" in line and "loss" in line for line in lines), lines
    assert "finished in" in lines[-1] and "peak memory: rank 0" in lines[-1]


def logs_then_exits_cleanly():
    Accelerator().log({"loss": 1.0}, step=0, main_process_only=False)
    sys.exit(0)


def test_metrics_waiting_for_their_batch_arrive_when_a_worker_exits():
    assert notebook_launcher(
        logs_then_exits_cleanly, num_processes=2, live=False, return_all=True, backend="cpu"
    ) == [None, None]
    assert sorted(record.rank for record in last_run().metrics) == [0, 1]


def test_a_failed_single_process_start_leaves_no_metric_sink_behind():
    import socket

    from notebook_accel.reporting import destination

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            notebook_launcher(
                logs_steps,
                args=(1,),
                num_processes=1,
                use_port=busy.getsockname()[1],
                live=False,
                backend="cpu",
            )
    assert destination.current() == destination.Destination()
