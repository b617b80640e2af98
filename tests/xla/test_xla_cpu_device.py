"""A real launch on XLA's CPU device, in the torch_xla environment (tests/xla/make_env.py).

torch_xla pins its own torch, so the launch runs in a separate, cached
environment through a subprocess; `.ci/run` builds that environment first.
The scenario (scenario_cpu_device.py) runs with PJRT_DEVICE=CPU and
CPU_NUM_DEVICES=1: with two or more CPU devices, torch_xla 2.9's collectives
deadlock, so several cores are verified on TPUs only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import make_env  # noqa: E402
import venv_cache  # noqa: E402

from tests_support import PROMPTLY  # noqa: E402


@pytest.fixture(scope="module")
def xla_python() -> Path:
    try:
        return make_env.ensure()
    except (subprocess.CalledProcessError, SystemExit) as error:
        if not venv_cache.pip_finds("torch_xla", make_env.TORCH_XLA_VERSION):
            pytest.skip(
                f"the torch_xla environment cannot be built: pip finds no torch_xla "
                f"{make_env.TORCH_XLA_VERSION} with its configuration ({error}); run "
                "`python tests/xla/make_env.py` where its package index is reachable"
            )
        raise


def xla_environment() -> dict[str, str]:
    """This environment, without what would steer torch_xla or a launch elsewhere, and
    with this checkout on PYTHONPATH (the shared environment holds none)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PJRT_", "TPU_", "XLA_", "NOTEBOOK_ACCEL_"))
        and name not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    return make_env.environment(base=env)


@pytest.fixture(scope="module")
def scenario(xla_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    done = subprocess.run(
        [str(xla_python), str(HERE / "scenario_cpu_device.py")],
        cwd=tmp_path_factory.mktemp("xla"),
        env=xla_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    checks = {}
    for line in done.stdout.splitlines():
        if line.startswith('{"check"'):
            record = json.loads(line)
            checks[record.pop("check")] = record
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"checks": checks, "stdout": done.stdout}


pytestmark = pytest.mark.timeout(2400)  # the first run builds the environment


def run_scenario(
    xla_python: Path, script: str, cwd: Path
) -> tuple[dict, subprocess.CompletedProcess]:
    """Run `script` in a fresh interpreter of the torch_xla environment (nothing heavy
    imported yet, as in a new kernel); what its last line of output says (JSON)."""
    done = subprocess.run(
        [str(xla_python), str(HERE / script)],
        cwd=cwd,
        env=xla_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def test_training_matches_the_cpu_and_comes_back(scenario):
    train = scenario["checks"]["train"]
    assert train["status"] == "finished" and train["backend"] == "xla"
    assert train["devices"] == ["xla:0"]
    assert train["num_processes"] == 1
    # The same steps in plain PyTorch on the CPU give the same weights.
    assert train["matches_cpu"], train["max_difference"]
    assert train["predictions"] == [8, 1]  # gather_for_metrics: one row per sample
    assert train["reduced"] == 2.0
    assert train["losses"] == 8  # every accelerator.log reached last_run()
    assert "trained on xla:0" in scenario["stdout"]  # the worker's print reached us


def test_xla_save_writes_cpu_tensors_that_load_back(scenario):
    train = scenario["checks"]["train"]
    assert train["saved_on"] == ["cpu"]
    assert train["reload_exact"]


def test_save_state_round_trip(scenario):
    assert scenario["checks"]["train"]["save_state"] == "exact"


def test_bf16_autocast_on_xla(scenario):
    assert scenario["checks"]["bf16"]["result"] == "bf16 torch.bfloat16 torch.float32"


def test_failing_worker_is_a_worker_error_with_its_traceback(scenario):
    failure = scenario["checks"]["failure"]
    assert failure["rank"] == 0
    assert failure["traceback_has_cause"] and failure["traceback_names_function"]
    assert "ValueError: this worker fails on purpose" in failure["message"]


def test_timeout_stops_the_worker(scenario):
    timeout = scenario["checks"]["timeout"]
    # Not before its limit; after it, as soon as the worker is stopped (the worker sleeps
    # for 600 s), however busy the machine.
    assert timeout["limit"] <= timeout["seconds"] < timeout["limit"] + PROMPTLY


def test_once_the_runtime_started_here_forking_is_refused_and_a_fresh_start_works(scenario):
    assert "XLA runtime is already initialised" in scenario["checks"]["refused"]["message"]
    assert "start_method='fork' cannot work here" in scenario["checks"]["refused"]["message"]
    fresh = scenario["checks"]["fresh"]
    assert fresh["value"] == 2.0 and fresh["start_method"] == "forkserver"


def test_run_all_a_launch_then_training_in_the_kernel_then_a_launch(xla_python, tmp_path):
    """One round: the race this scenario once lost (imports on two threads, 7 rounds in
    8) is in the launcher's warming, not in the device's code, and
    test_warm_never_races.py runs the same Run All in fresh rounds on the CPU."""
    seen, done = run_scenario(xla_python, "scenario_run_all.py", tmp_path)
    # The first launch's imports wait for the second, which does them before it forks.
    expected = {"first": "xla:0", "second": "xla:0", "warming": ["next launch", "done"]}
    assert seen == expected, seen
    assert "Traceback" not in done.stderr, done.stderr


def test_an_accelerator_made_outside_a_launch_trains_on_the_tpu(xla_python, tmp_path):
    """As Accelerate's Accelerator() in a Colab TPU kernel: one process on xla:0."""
    seen, _ = run_scenario(xla_python, "scenario_kernel_accelerator.py", tmp_path)
    assert seen["state"] == ["xla", "xla:0", 1]
    assert not seen["started_by_the_state"]  # PartialState() alone does not claim the TPU
    assert seen["accelerator"] == ["xla:0", 1]
    assert seen["batches_on"] == ["xla:0"]
    assert seen["matches_cpu"] and seen["reduced"] == 2.0
    assert seen["started_by_training"]
    assert (
        "accelerator.prepare(model) with an Accelerator made outside a launch" in (seen["refused"])
    )


def test_the_shared_environment_points_at_no_checkout(xla_python):
    """Each run brings its own checkout on PYTHONPATH; the environment holds none."""
    assert make_env.checkout_pointer() == ""
    found = Path(make_env.imported_from(xla_environment()))
    assert found.is_relative_to(make_env.REPO)


def test_two_checkouts_share_one_environment_and_each_runs_its_own(monkeypatch, tmp_path):
    shared = make_env.venv_dir()
    for checkout in (tmp_path / "one", tmp_path / "two"):
        monkeypatch.setattr(make_env, "REPO", checkout)
        assert make_env.venv_dir() == shared  # nothing of the checkout in its key
        env = make_env.environment(checkout, base={"PYTHONPATH": "/elsewhere"})
        assert env["PYTHONPATH"] == os.pathsep.join([str(checkout), "/elsewhere"])


def test_the_xla_extra_pins_the_pair_this_environment_tests():
    import tomllib

    project = tomllib.loads((make_env.REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["xla"]
    assert f"torch_xla[tpu]=={make_env.TORCH_XLA_VERSION}" in extra
    assert f"torch=={make_env.TORCH_VERSION}" in extra
