"""Each tracker Accelerate supports, against the real package, offline, read back from what the
package itself wrote (its store, run directory or repository), not from our own calls.

A run logs two steps and a config through `Accelerator(log_with=name)` in a fresh
interpreter (so the package's background services and settings end with it), then the
test reads the package's files. The runs use this interpreter where it has the
package, else the tracker environment (tests/accelerator/tracker_env.py, which
`make test` builds); with neither, the tests skip saying how to get one.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import tracker_env  # noqa: E402

RUN = """
import sys
from notebook_accel import Accelerator

name, folder, kwargs = sys.argv[1], sys.argv[2], eval(sys.argv[3])
accelerator = Accelerator(log_with=name, project_dir=folder)
accelerator.init_trackers("proj", config={"lr": 0.1, "tag": "x"}, init_kwargs=kwargs)
run = accelerator.get_tracker(name, unwrap=True)
assert type(run).__module__.split(".")[0] == name, f"unwrap gave {type(run)}"
# end_training itself must end the library's run (a kernel never exits to do it): each
# way a run ends that the library's run object has is watched (MLflow ends runs by module).
ended = []
for method in ("finish", "end", "close") if name != "mlflow" else ():
    if hasattr(run, method):
        real = getattr(run, method)
        setattr(run, method, lambda *a, real=real, **k: ended.append(1) or real(*a, **k))
accelerator.log({"loss": 0.5}, step=1)
accelerator.log({"loss": 0.25}, step=2)
accelerator.end_training()
assert ended or name == "mlflow", f"end_training did not end the {name} run"
"""

LOSSES = [(1, 0.5), (2, 0.25)]


def _python_with(module: str) -> str:
    """An interpreter that has `module`: this one, else the tracker environment's."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return sys.executable
    python = tracker_env.venv_python()
    if not python.exists():
        pytest.skip(
            f"{module} is not installed here and there is no tracker environment: run "
            "`.venv/bin/python tests/accelerator/tracker_env.py` (make test does), or "
            'pip install -e ".[dev,trackers]"'
        )
    return str(python)


def _run(name: str, folder: Path, env: dict[str, str], kwargs: dict | None = None) -> None:
    """One logged run of tracker `name` in a fresh interpreter, with `folder` as its cwd."""
    import os

    environment = {**os.environ, **env}
    done = subprocess.run(
        [_python_with(name), "-c", RUN, name, str(folder), repr(kwargs or {})],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_mlflow_writes_the_metrics_and_params_into_its_file_store(tmp_path):
    # MLflow 3 keeps its file store only on request; it is the store that needs no server.
    store = tmp_path / "mlruns"
    _run(
        "mlflow",
        tmp_path,
        {"MLFLOW_TRACKING_URI": store.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    (metrics,) = store.glob("*/*/metrics/loss")
    rows = [line.split() for line in metrics.read_text().splitlines()]
    assert [(int(step), float(value)) for _, value, step in rows] == LOSSES
    params = metrics.parent.parent / "params"
    assert (params / "lr").read_text() == "0.1" and (params / "tag").read_text() == "x"
    name = (metrics.parent.parent.parent / "meta.yaml").read_text()
    assert "name: proj" in name


# Reads a wandb run file (LevelDB-style log blocks of protobuf records after a 7-byte
# header) with wandb's own record class, and prints what the run logged as JSON.
READ_WANDB = """
import json, sys
from wandb.proto import wandb_internal_pb2

data = open(sys.argv[1], "rb").read()
assert data[:4] == b":W&B", "not a wandb run file"
position, block, pending = 7, 32768, b""
history, config, project = [], {}, None
while position + 7 <= len(data):
    left = block - position % block
    length = int.from_bytes(data[position + 4 : position + 6], "little")
    kind = data[position + 6]
    if left < 7 or kind == 0:  # a block's zero padding
        position += left
        continue
    pending += data[position + 7 : position + 7 + length]
    position += 7 + length
    if kind not in (1, 4):  # not yet a whole record, nor the last piece of one
        continue
    record = wandb_internal_pb2.Record()
    record.ParseFromString(pending)
    pending = b""
    which = record.WhichOneof("record_type")
    if which == "history":
        items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
        if "loss" in items:
            history.append((int(items["_step"]), json.loads(items["loss"])))
    elif which == "config":
        config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    elif which == "run":
        project = record.run.project
print(json.dumps({"history": history, "config": config, "project": project}))
"""


def test_wandb_offline_writes_the_history_and_config_into_its_run_directory(tmp_path):
    _run("wandb", tmp_path, {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    done = subprocess.run(
        [_python_with("wandb"), "-c", READ_WANDB, str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logged = json.loads(done.stdout.splitlines()[-1])
    assert [tuple(row) for row in logged["history"]] == LOSSES
    config = logged["config"]
    assert (config["lr"], config["tag"], logged["project"]) == (0.1, "x", "proj")


def test_dvclive_writes_the_metrics_and_params_files(tmp_path):
    folder = tmp_path / "dvclive"
    _run("dvclive", tmp_path, {}, {"dvclive": {"dir": str(folder), "save_dvc_exp": False}})
    rows = (folder / "plots" / "metrics" / "loss.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["step", "loss"]
    assert [(int(s), float(v)) for s, v in (row.split("\t") for row in rows[1:])] == LOSSES
    assert yaml.safe_load((folder / "params.yaml").read_text()) == {"lr": 0.1, "tag": "x"}


AIM_READER = """
import sys
from aim import Repo, Run

repo = Repo(sys.argv[1])
for run_hash in repo.list_all_runs():
    run = Run(run_hash, repo=repo, read_only=True)
    losses = [m for m in run.metrics() if m.name == "loss"]
    steps = [list(zip(m.data.indices(), m.values.values_list())) for m in losses]
    print(repr((run.name, run["hparams"], steps)))
"""


def test_aim_writes_the_run_into_its_repository(tmp_path):
    _run("aim", tmp_path, {})
    python = _python_with("aim")
    # Aim's readers see a run once its repository's index holds it; its UI indexes in the
    # background, a script does so with Aim's own command
    index = "from aim.cli.cli import cli_entry_point; cli_entry_point()"
    command = [python, "-c", index, "storage", "--repo", str(tmp_path), "reindex", "-y"]
    subprocess.run(command, capture_output=True, check=True, timeout=150)
    done = subprocess.run(
        [python, "-c", AIM_READER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=150,
        check=True,
    )
    runs = [eval(line) for line in done.stdout.splitlines()]
    assert runs == [("proj", {"lr": 0.1, "tag": "x"}, [LOSSES])]


def test_trackio_writes_the_run_into_its_local_database(tmp_path):
    _run("trackio", tmp_path, {"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HOME": str(tmp_path)})
    with sqlite3.connect(tmp_path / "trackio" / "proj.db") as db:
        rows = db.execute("select step, metrics from metrics order by step").fetchall()
        (config,) = db.execute("select config from configs").fetchall()
    assert [(step, json.loads(values)["loss"]) for step, values in rows] == LOSSES
    assert {k: v for k, v in json.loads(config[0]).items() if not k.startswith("_")} == {
        "lr": 0.1,
        "tag": "x",
    }


def test_swanlab_local_mode_writes_the_metric_log_and_config(tmp_path):
    _run(
        "swanlab",
        tmp_path,
        {"SWANLAB_MODE": "local", "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")},
    )
    (run,) = (tmp_path / "swanlog").glob("run-*")
    logged = [
        json.loads(line)
        for log in sorted((run / "logs").glob("*/*.log"))
        for line in log.read_text().splitlines()
    ]
    assert [(entry["index"], entry["data"]) for entry in logged] == LOSSES
    config = yaml.safe_load((run / "files" / "config.yaml").read_text())
    assert (config["lr"]["value"], config["tag"]["value"]) == (0.1, "x")


def test_comet_offline_writes_the_metrics_and_parameters_into_its_archive(tmp_path):
    _run(
        "comet_ml",
        tmp_path,
        {"COMET_OFFLINE_DIRECTORY": str(tmp_path / "comet")},
        {"comet_ml": {"online": False}},
    )
    (archive,) = (tmp_path / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as opened:
        messages = [json.loads(line) for line in opened.read("messages.json").splitlines()]
    payloads = [m.get("payload", m) for m in messages]
    metrics = [p["metric"] for p in payloads if isinstance(p.get("metric"), dict)]
    assert [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "loss"] == LOSSES
    # Comet also records the program's arguments by itself ("source": "auto"), and the
    # step set_step() gave ("curr_step")
    params = [p["param"] for p in payloads if "param" in p]
    mine = {p["paramName"]: p["paramValue"] for p in params if p.get("source") == "manual"}
    assert mine == {"lr": 0.1, "tag": "x", "curr_step": 2}


def test_clearml_offline_writes_the_scalars_into_its_session(tmp_path):
    _run(
        "clearml",
        tmp_path,
        {"CLEARML_OFFLINE_MODE": "1", "CLEARML_CACHE_DIR": str(tmp_path / "clearml")},
    )
    (session,) = [p for p in (tmp_path / "clearml" / "offline").glob("offline-*") if p.is_dir()]
    lines = (session / "metrics.jsonl").read_text().splitlines()
    events = [event for line in lines for event in json.loads(line)]  # a list of events a line
    scalars = [e for e in events if e.get("type") == "training_stats_scalar"]
    assert [(e["iter"], e["value"]) for e in scalars if e["metric"] == "loss"] == LOSSES
    task = json.loads((session / "task.json").read_text())
    assert task["name"] == "proj"
